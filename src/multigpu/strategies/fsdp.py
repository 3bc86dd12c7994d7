"""FSDP2: `torch.distributed.fsdp.fully_shard`, once per transformer block, then the root.

Each call makes a unit: its parameters become DTensors sharded over the ranks (dim 0). In
forward a unit all-gathers its parameters just before use and, with
`reshard_after_forward=True` (ZeRO-3-like), frees them after; in backward it gathers them
again, and reduce-scatters the gradients so each rank keeps its shard. With
`reshard_after_forward=False` (ZeRO-2-like) the gathered parameters stay from forward to
backward: one all-gather fewer, more memory. Options (RunConfig.extra):
`reshard_after_forward` (default True); `wrap`: "blocks" (default) or "root" (the whole
model one unit: everything is gathered at once, so the peak holds every parameter).
dtype bf16-mixed adds a MixedPrecisionPolicy: bf16 parameters for compute, fp32 gradient
reduction.
"""

from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from multigpu.models import transformer_blocks
from multigpu.strategies import Parallelized, build_optimizer


def prepare(model, cfg, rt) -> Parallelized:
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    reshard = bool(cfg.extra.get("reshard_after_forward", True))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.dtype == "bf16-mixed" else MixedPrecisionPolicy())
    if cfg.extra.get("wrap", "blocks") == "blocks":  # "root": one unit, to show why units matter
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    optimizer = build_optimizer(model.parameters(), cfg)

    @contextmanager
    def no_sync():  # accumulate unsharded gradients; reduce-scatter on the last micro-batch
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def gather_state_dict():
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}

    return Parallelized(module=model, optimizer=optimizer, model=model, no_sync=no_sync,
                        gather_state_dict=gather_state_dict)

