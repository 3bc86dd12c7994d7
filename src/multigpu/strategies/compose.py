"""The order in which parallelisms are applied to a model: one place, for every composition.

A run's processes form a pp x dp x tp grid (`runtime.RankGrid`). The library strategies
build a model for it in four steps, always in this order (torchtitan's, and Hugging Face
transformers' `maybe_distribute_model`: pytorch/torchtitan at 42b0beb,
torchtitan/models/llama3/infra/parallelize.py and pipeline.py):

1. **Pipeline split** (`pp.build_stages`): each rank keeps its stages' blocks, from a whole
   model built from the same seed. It comes first because everything after works on the
   modules a rank keeps: there is no point cutting or sharding what it will delete.
2. **Tensor parallelism** (`tp_plan.parallelize`): every weight matrix of the kept modules is cut
   over the tp ranks and becomes a DTensor on the tp mesh. It must see the plain modules,
   whose paths its plan names.
3. **Activation checkpointing**: each block wrapped to recompute its forward in backward.
   Recomputing a tensor-parallel block repeats its collectives, which is correct because
   every rank of the tp group recomputes too.
4. **Data parallelism, sharded** (FSDP2 `fully_shard` on the dp mesh, each block, then
   the root; or hybrid, HSDP: sharded inside groups of dp ranks, replicated across them):
   it shards whatever the steps before left, including TP's DTensors (which become 2-D:
   `_StridedShard` on dp, `Shard` on tp), and gathers a block's parameters around its
   forward, also around its recomputation in backward. It comes last because it must wrap
   the final modules: sharding first and then swapping layers would swap out the sharded
   parameters.

5. **Context parallelism** (cp > 1): every attention swapped for the ring over this rank's cp line
   (cp_scratch.swap_attention), and the sequences cut last, outside: the returned module cuts each
   batch (cp_scratch.ContextParallel, around TP's LossModule when there is one); a pipeline stage's
   piece gets the attention only, its schedule's batches cut before the step (pp.py). FSDP then
   shards over the dp x cp ranks, which all hold the whole model (torchtitan's dp_shard_cp).

Under a pipeline, FSDP keeps the gathered parameters from forward to backward
(`reshard_after_forward=False`): a stage runs many micro-batches' forwards before their
backwards, and re-gathering for each would multiply the all-gathers by the micro-batches.

A mixture of experts' experts (`fsdp --ep N`, ep_scratch.shard_experts) are cut over ep ranks and
sharded over the ranks holding the same slice in step 4, before the blocks, which leave them out.

`fsdp --tp N` (2D) applies steps 2-4 to the whole model; `pp-* --tp N --dp N` (PP x TP,
PP x FSDP, 3D) applies step 1, then steps 2-4 to each stage. The from-scratch 2D
composition (`ddp-scratch --tp N`, in `ddp_scratch.py`) swaps the layers for
tp_scratch's and averages gradients over the dp group: the same order, by hand.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from multigpu import moe
from multigpu.models import apply_activation_checkpointing, transformer_blocks
from multigpu.strategies import tp_plan


def parallelize(model: nn.Module, cfg, grid, *, shard: bool, root: nn.Module | None = None,
                loss_parallel: bool | None = None, reshard_after_forward: bool = True,
                cut_sequence: bool = True) -> nn.Module:
    """Steps 2-4 of the order on `model` (a whole model, or one pipeline stage's piece), in
    place; step 4 when `shard` (FSDP over the grid's dp ranks). `root`: the module FSDP
    wraps last (default `model`; a pipeline stage passes the module the schedule calls,
    which must itself be the FSDP module). Returns the module
    whose call computes the loss: `tp_plan.LossModule` when tp > 1 (loss-parallel cross-entropy
    needs its context), else `model`. loss_parallel: None reads extra `loss_parallel`
    (default on); a pipeline stage, whose loss the schedule computes, passes False. With cp,
    `cut_sequence`: the returned module cuts each batch's sequences (False: a pipeline stage's piece,
    whose attention alone is swapped; the schedule's batches are cut before its step)."""
    module = model
    extra = cfg.extra or {}
    if grid.size("tp") > 1:  # 2. tensor parallel
        module = tp_plan.parallelize(
            model, grid.mesh["tp"], sequence_parallel=bool(extra.get("sequence_parallel")),
            loss_parallel=extra.get("loss_parallel", True) if loss_parallel is None else loss_parallel)
    if cfg.activation_checkpointing:  # 3. activation checkpointing
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if shard:  # 4. data parallel, sharded (or hybrid: sharded in groups, the groups replicas)
        replicas = int(extra.get("replicas", 1))
        dp_mesh = grid.mesh["dp"] if replicas == 1 else hybrid_mesh(grid, replicas)
        if grid.size("cp") > 1:  # each cp rank holds the whole model too: shard over dp x cp (torchtitan's dp_shard_cp)
            dp_mesh = grid.mesh["dp", "cp"]._flatten("dp_cp")
        if moe.layers(model):  # a mixture of experts: its counts summed over dp; with --ep its experts cut and
            # sharded over their copies first, so that the blocks' units leave them out (torchtitan's order)
            from multigpu.strategies import ep_scratch

            ep_scratch.shard_experts(model, cfg, grid, reshard_after_forward=reshard_after_forward,
                                     mp_policy=precision(cfg))
        fully_shard_blocks(model, dp_mesh, cfg, root=root, reshard_after_forward=reshard_after_forward)
    if grid.size("cp") > 1:  # the sequence cut last, outside: the wrapper only slices batches and sums losses
        from multigpu.strategies import cp_scratch

        if cut_sequence:
            module = cp_scratch.parallelize(model, cfg, grid, inner=module)  # TP's LossModule, if any, inside
        else:
            cp_scratch.swap_attention(model, cfg, grid)
    return module


def fully_shard_blocks(model: nn.Module, dp_mesh, cfg, *, root: nn.Module | None = None,
          reshard_after_forward: bool = True) -> None:
    """FSDP2 over the data-parallel ranks: each transformer block one unit, then the root.
    dtype bf16-mixed: bf16 parameters for compute, fp32 gradient reduction.
    extra `wrap`: "blocks" (default) or "root" (the whole model one unit)."""
    mp = precision(cfg)
    if (cfg.extra or {}).get("wrap", "blocks") == "blocks":
        for block in transformer_blocks(model):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(root or model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)


def precision(cfg) -> MixedPrecisionPolicy:
    """FSDP's mixed precision: under bf16-mixed bf16 parameters for compute, fp32 gradient reduction."""
    return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if cfg.dtype == "bf16-mixed" else MixedPrecisionPolicy())


def hybrid_mesh(grid, replicas: int):
    """The dp ranks as a 2-D mesh (dp_replicate, dp_shard) for hybrid sharding (HSDP,
    `fully_shard` on a 2-D mesh): parameters sharded over the dp_shard ranks, which are
    consecutive (on a cluster, the GPUs of one node, joined by the fast links), and whole
    copies of those shards kept by each of the `replicas` groups (across nodes), whose
    gradients are all-reduced over the slow links once per step: the all-gathers of every
    block stay inside a node (Zhao et al. 2023, PyTorch FSDP, https://arxiv.org/abs/2304.11277, §3.2.2)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = grid.size("dp")
    if dp % replicas:
        raise ValueError(f"{replicas} replicas do not divide the {dp} data-parallel ranks; use a divisor of {dp}")
    mesh = init_device_mesh(grid.device_type, (grid.size("pp"), replicas, dp // replicas, grid.size("cp"),
                                               grid.size("tp")),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    return mesh["dp_replicate", "dp_shard"]
