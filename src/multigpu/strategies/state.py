"""The whole weights again: what a strategy that cuts or shards the model hands back.

A run's record, the parity checks and `Parallelized.full_state_dict` compare a strategy's
weights with one device's: the same names, whole tensors, on every rank. Three kinds of
cut model are put back together here:

- DTensors (the library's tensor parallelism, FSDP2, both at once): each knows its mesh and
  placement and gathers itself (`whole_state_dict`); the library TP's three q, k, v layers
  are fused back into attention's one projection (`fused_state_dict`).
- tp_scratch's slices: plain Parameters that remember how they were cut
  (`tensor_parallel_dim`, `tensor_parallel_parts`, set by `tp_scratch._shard`):
  `sliced_state_dict` all-gathers them over the tp group (`sliced_grads` their gradients,
  for the parity tests).
- pipeline stages: each rank holds its stages' pieces, which `pipeline_state_dict` puts
  together over the pp group (each piece gathered whole first: under `--tp` or `--dp` its
  weights are DTensors).

Every function here is collective: every rank of the group (or the tensors' mesh) calls it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from multigpu.strategies.tp_regions import all_gather


def fused_state_dict(state: dict) -> dict:
    """A state dict of a model whose attention went through tp_plan.QKV, under the single-device
    names again: blocks.i.attn.qkv.{q,k,v}.weight -> blocks.i.attn.qkv.weight (and bias)."""
    out = {}
    for name, value in state.items():
        head, _, leaf = name.rpartition(".")
        if head.endswith(".qkv.q"):
            base = head[:-2]
            out[f"{base}.{leaf}"] = torch.cat([state[f"{base}.{p}.{leaf}"] for p in "qkv"])
        elif not (head.endswith(".qkv.k") or head.endswith(".qkv.v")):
            out[name] = value
    return out


def whole_state_dict(module: nn.Module) -> dict:
    """`module`'s state dict with every DTensor (cut by TP, sharded by FSDP) gathered whole,
    under the single-device names (`fused_state_dict`)."""
    return fused_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                             for k, v in module.state_dict().items()})


def sliced_state_dict(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """Every parameter of a model whose layers tp_scratch swapped (the GPT itself, not the
    TensorParallelLM around it) whole, under the single-device names, on every rank of the group."""
    return _unsliced(model, group, lambda p: p.detach())


def sliced_grads(model: nn.Module, group) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient whole, as `sliced_state_dict` (for parity tests)."""
    return _unsliced(model, group, lambda p: p.grad)


def _unsliced(model: nn.Module, group, read) -> dict[str, torch.Tensor]:
    out, done = {}, {}
    # state_dict's names are the single-device ones: checkpoint_wrapper strips its prefix, and
    # a tied weight appears under both names (gathered once)
    for name, p in model.state_dict(keep_vars=True).items():
        if id(p) not in done:
            t, dim = read(p), getattr(p, "tensor_parallel_dim", None)
            done[id(p)] = t if t is None or dim is None else _whole(t.detach(), dim, p.tensor_parallel_parts, group)
        out[name] = done[id(p)]
    return out


def _whole(shard: torch.Tensor, dim: int, parts: int, group) -> torch.Tensor:
    """Undo `tp_scratch._shard`: gather every rank's piece along dim; a fused tensor's pieces
    come back as [rank 0's q k v | rank 1's q k v | ...] and are regrouped into
    [all q | all k | all v]."""
    gathered = all_gather(shard, dim, group)
    if parts == 1:
        return gathered
    tp = dist.get_world_size(group)
    pieces = gathered.chunk(tp * parts, dim)  # rank-major: (rank, part)
    return torch.cat([pieces[r * parts + k] for k in range(parts) for r in range(tp)], dim)


def pipeline_state_dict(pieces: list[nn.Module], grid) -> dict[str, torch.Tensor]:
    """Every stage's parameters, whole model, on every rank of the pipeline, under the
    single-device names (a tied weight under both of its names, as GPT.state_dict has).
    `pieces`: this rank's stages' pieces of the GPT (one, or two under interleaved and V
    schedules, `pp_split.split_gpt`), whose weights may be DTensors (tensor parallel, FSDP)."""
    mine = {}
    for piece in pieces:
        mine.update({k: v.detach().cpu().clone() for k, v in whole_state_dict(piece).items()})
    parts = [None] * grid.size("pp")
    dist.all_gather_object(parts, mine, group=grid.group("pp"))
    state = {}
    for part in parts:
        state.update(part)
    if pieces[0].cfg.tie_embeddings and "wte.weight" in state:
        state.setdefault("lm_head.weight", state["wte.weight"])
    return state
