"""The `cp` strategy: PyTorch's own context parallelism, on CUDA GPUs.

`torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`
is a context manager: it cuts the buffers given (here the batch's token ids, labels and
positions) along the sequence in place, with the head-tail (zig-zag) layout, and inside it runs
`scaled_dot_product_attention` in ring order over the mesh's ranks, forward and backward. By
default it all-gathers each layer's keys and values once (`_cp_options.rotate_method` is
ALL_GATHER); `set_rotate_method("alltoall")` passes them rank to rank instead, which this
strategy sets for its ring (`ROTATION`). It replaces the attention kernels by name, CUDA's only
(flash, memory-efficient, cuDNN; in torch/distributed/tensor/experimental/_context_parallel/
_attention.py, `custom_ops`). On a CPU attention runs `_scaled_dot_product_flash_attention_for_cpu`
on the sequence-sharded DTensors, and DTensor has no sharding rule for it: the first attention
raises NotImplementedError (tests/test_cp.py holds this). So the device plan refuses it off CUDA
(the strategy table's `cuda_only`); `cp-scratch` is the same idea written here, on any device.

Each micro-batch's forward and backward run inside the context (Parallelized's
`around_micro_batch`). As in cp-scratch, every rank holds the whole model, reports the whole
sequences' loss, and the gradients are averaged over the dp x cp ranks. Option `cp_attention`:
ring (default; PyTorch's "alltoall" rotation, keys and values passed to the next rank) or
allgather; Ulysses is not PyTorch's.
"""

from __future__ import annotations

import torch

from multigpu.strategies import Parallelized, cp_scratch

ROTATION = {"ring": "alltoall", "allgather": "allgather"}  # this package's names -> set_rotate_method's


def config_problems(cfg) -> list[str]:
    """What RunConfig.validate reports; the device, which is the machine's to say, the device plan
    checks (the strategy table's `cuda_only`: it refuses a CPU before any process starts)."""
    variant, balance = cp_scratch.options(cfg)
    problems = []
    if variant not in ROTATION:
        problems.append(f"PyTorch's context parallelism offers {' and '.join(ROTATION)}, not {variant!r} (Ulysses "
                        "is cp-scratch's)")
    if balance != "zigzag":
        problems.append("PyTorch's context parallelism cuts the sequence head-tail (zigzag) only")
    return problems


def prepare(model, cfg, rt) -> Parallelized:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    variant, _ = cp_scratch.options(cfg)
    mesh = rt.grid.mesh["cp"]
    set_rotate_method(ROTATION[variant])

    def around_micro_batch(batch: dict):
        """Positions for the model (they are cut with the tokens), then the context that cuts them
        all in place and swaps attention for the ring, around this micro-batch's forward and backward."""
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1], device=batch["input_ids"].device)
        buffers = [batch["input_ids"], batch["labels"], batch["position_ids"]]
        return context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers))

    module = cp_scratch.ContextParallel(model, mesh.get_group(), "zigzag")
    return cp_scratch.replicas(model, module, cfg, around_micro_batch=around_micro_batch,
                               report=lambda: {"cp_attention": variant, "implementation": "torch context_parallel"})
