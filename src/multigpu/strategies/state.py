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

The same tensors are what a checkpoint saves (multigpu.checkpoint), named so that another layout can
find them: `checkpoint_state` gives this rank's weights and optimizer state under the single-device
names ("canonical": whole tensors, or DTensors that say where their piece lies; the library TP's three
q, k, v layers fused again, a tied weight's state under both its names), or, for a strategy that cuts
tensors its own way into plain tensors, under this rank's own keys ("local"); `checkpoint_targets` the
live tensors a load writes into, and `put_back_checkpoint_state` what is left to do after it.
"""

from __future__ import annotations

import json
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict
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
    return fused_state_dict({k: _whole_tensor(v) for k, v in module.state_dict().items()})


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


# -- checkpoints ---------------------------------------------------------------------------------------

_QKV = re.compile(r"(.*\.qkv)\.([qkv])\.(weight|bias)$")  # the library TP's attention (tp_plan.QKV)


def _module_optimizer(par) -> tuple[nn.Module, torch.optim.Optimizer]:
    """What holds the weights and the optimizer whose state is this rank's (ZeroRedundancyOptimizer: the
    optimizer over its own partition)."""
    optimizer = par.optimizer
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        optimizer = optimizer.optim
    # FSDP1's flat parameters are the model's weights only seen through its wrapper
    module = par.module if type(par.module).__name__ == "FullyShardedDataParallel" else par.model
    return module, optimizer


def _canonical_name(module: nn.Module, name: str) -> str:
    """A pipeline rank keeps its stages in an nn.ModuleList: `0.blocks.3.x` (or `0.piece.blocks.3.x`, the
    library's stage around its piece) is `blocks.3.x`."""
    return re.sub(r"^\d+\.(piece\.)?", "", name) if isinstance(module, nn.ModuleList) else name


def _whole_tensor(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _canonical(module: nn.Module, model_sd: dict, optim_state: dict) -> tuple[dict, dict, dict]:
    """(model, optimizer state) under the single-device names, and the live tensors each fused name stands
    for. The library TP holds attention's [q | k | v] projection as three layers: saved, they become the one
    tensor the model has (gathered whole: every rank holds the same, written once)."""
    model, optim, fused = {}, {}, {}
    for name, value in model_sd.items():
        name = _canonical_name(module, name)
        if m := _QKV.fullmatch(name):
            fused.setdefault(f"{m[1]}.{m[3]}", {})[m[2]] = name
        else:
            model[name] = value
    for name, state in optim_state.items():
        name = _canonical_name(module, name)
        if not _QKV.fullmatch(name):
            optim[name] = state
    # a tied weight (GPT-2's embedding and head) is one tensor under two names, whose state the optimizer
    # keeps under one of them; a pipeline holds it twice (first and last stage), each copy with its state
    # under its own name: saved under both, every layout finds the one it needs
    names_by_tensor: dict[tuple, list[str]] = {}
    for name, value in model.items():
        local = local_tensor(value)
        names_by_tensor.setdefault((local.data_ptr(), local.shape, local.stride()), []).append(name)
    for names in names_by_tensor.values():
        if (held := [n for n in names if n in optim]) and len(names) > 1:
            for n in names:
                optim.setdefault(n, optim[held[0]])
    for whole_name, parts in fused.items():
        live = {p: [k for k in model_sd if _canonical_name(module, k) == parts[p]][0] for p in "qkv"}
        model[whole_name] = torch.cat([_whole_tensor(model_sd[live[p]]) for p in "qkv"])
        states = [optim_state.get(live[p]) for p in "qkv"]
        if states[0] is not None:
            optim[whole_name] = {k: torch.cat([_whole_tensor(s[k]) for s in states]) if states[0][k].dim()
                                 else states[0][k] for k in states[0]}
        fused[whole_name] = live
    return model, optim, fused


def _cut_fused(whole: torch.Tensor, parts: list) -> None:
    """Put a loaded fused tensor's thirds back into the live q, k, v tensors (DTensors: each rank its rows)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for third, live in zip(whole.chunk(3), parts):
        if isinstance(live, DTensor):
            shape, offset = compute_local_shape_and_global_offset(third.shape, live.device_mesh, live.placements)
            piece = third[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            live.to_local().copy_(piece)
        else:
            live.copy_(third)


def local_tensor(t):
    """This rank's piece of a DTensor (a view: writing into it writes the DTensor); any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def checkpoint_state(par, rank: int) -> tuple[dict, dict]:
    """(what this rank saves, how to put a loaded copy of it back): the weights and optimizer state."""
    module, optimizer = _module_optimizer(par)
    if par.checkpoint_names == "local":  # the module's tensors (but those a ZeRO-3 frees between steps), and the
        # optimizer's own parameters (the from-scratch ZeRO's flat shards) and their state, by position
        optim = optimizer.state_dict()
        live = {k: v for k, v in module.state_dict(keep_vars=True).items() if local_tensor(v).untyped_storage().size()}
        model = {k: local_tensor(v).detach() for k, v in live.items()}
        held = {t.data_ptr() for t in model.values()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {"model": model,  # the optimizer's parameters that are not the module's own tensors (saved once)
                "params": {str(i): local_tensor(p.data) for i, p in enumerate(params)
                           if local_tensor(p.data).data_ptr() not in held},
                "optimizer": {str(i): {k: local_tensor(v) for k, v in s.items()} for i, s in optim["state"].items()}}
        # where every piece lies in the whole tensors, under the single-device names: what lets another layout
        # read this one (multigpu.checkpoint.canonical_copy)
        places = _local_places(module, live, params, mine)
        return {f"rank{rank}": {**mine, "places": json.dumps(places)}}, {"local": True, "places": places,
                                                                         "state": mine}
    model_sd, optim_sd = get_state_dict(module, optimizer)
    model, optim, fused = _canonical(module, model_sd, optim_sd["state"])
    return {"model": model, "optimizer": optim}, {"model_sd": model_sd, "optim_sd": optim_sd, "fused": fused}


# -- a local layout's pieces, and where they lie in the whole tensors ----------------------------------------
#
# A place is [whole name, whole shape, how]: how is ["block", whole_block, piece_block] (per dimension
# [start, stop]: whole[whole_block] is piece[piece_block]), ["flat", piece_start, whole_start, length]
# (ranges of the flattened tensors: a from-scratch ZeRO's flat shard over its parameters) or ["scalar"]
# (an optimizer's step count). Whole names are a canonical checkpoint's: model.<name>, optimizer.<name>.<key>.


def _rows_of_experts(module: nn.Module) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (first row, rows in all) for each expert-parallel layer's stacked experts."""
    from multigpu import moe

    rows = {}
    for layer in moe.layers(module):
        group = getattr(layer.dispatch, "group", None)
        if group is not None:
            for p in layer.experts.parameters():
                rows[id(p)] = (dist.get_rank(group) * p.shape[0], layer.experts_total)
    return rows


def _blocks(t, rows: tuple[int, int] | None) -> list[tuple[list, list, list]]:
    """[(whole shape, whole block, piece block)] of a live tensor: a DTensor's piece, an expert-parallel
    rank's rows of the experts, a tp_scratch slice (of each of its fused parts), or itself whole."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = local_tensor(t)
    shape, piece = list(t.shape), [[0, n] for n in local.shape]
    if isinstance(t, DTensor):
        lshape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        block = [[o, o + n] for o, n in zip(offset, lshape)]
    else:
        block = [list(b) for b in piece]
    if rows is not None:
        first, total = rows
        shape[0], block[0] = total, [block[0][0] + first, block[0][1] + first]
    dim = getattr(t, "tensor_parallel_dim", None)
    if dim is None:
        return [(shape, block, piece)]
    parts, (rank, tp) = t.tensor_parallel_parts, t.tensor_parallel_place
    c = local.shape[dim] // parts  # each part's rows on this rank
    shape[dim] = c * tp * parts
    out = []
    for k in range(parts):
        whole_block, piece_block = [list(b) for b in block], [list(b) for b in piece]
        whole_block[dim], piece_block[dim] = [(k * tp + rank) * c, (k * tp + rank + 1) * c], [k * c, (k + 1) * c]
        out.append((shape, whole_block, piece_block))
    return out


def tensor_names(module: nn.Module) -> dict[int, list[str]]:
    """id(tensor) -> every single-device name it has in `module`'s state dict (a tied weight has two)."""
    names: dict[int, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(_canonical_name(module, name))
    return names


def _local_places(module: nn.Module, live: dict, params: list, mine: dict) -> dict[str, list]:
    """{key of this rank's state (model.<name>, params.<i>, optimizer.<i>.<key>): [place, ...]}."""
    names = tensor_names(module)
    rows = _rows_of_experts(module)
    places = {f"model.{k}": [[f"model.{_canonical_name(module, k)}", shape, ["block", block, piece]]
                             for shape, block, piece in _blocks(t, rows.get(id(t)))] for k, t in live.items()}

    def of(p, prefix: str, suffix: str, scalar: bool) -> list:
        flat = getattr(p, "flat_shards", None)
        if flat is not None:  # a from-scratch ZeRO's shard: ranges of its parameters
            found = []
            for q, start, n, shape in zip(flat.params, flat.starts, flat.numels, flat.shapes):
                lo, hi = max(start, flat.lo), min(start + n, flat.hi)
                if lo < hi:
                    found += [[f"{prefix}.{name}{suffix}", [], ["scalar"]] if scalar else
                              [f"{prefix}.{name}{suffix}", list(shape), ["flat", lo - flat.lo, lo - start, hi - lo]]
                              for name in names[id(q)]]
            return found
        if scalar:  # a step count: one per parameter, the same on every rank
            return [[f"{prefix}.{name}{suffix}", [], ["scalar"]] for name in names.get(id(p), [])]
        return [[f"{prefix}.{name}{suffix}", shape, ["block", block, piece]]
                for name in names.get(id(p), []) for shape, block, piece in _blocks(p, rows.get(id(p)))]

    for i, p in enumerate(params):
        if str(i) in mine["params"]:
            places[f"params.{i}"] = of(p, "model", "", False)
        for key, value in mine["optimizer"].get(str(i), {}).items():
            places[f"optimizer.{i}.{key}"] = of(p, "optimizer", f".{key}", value.dim() == 0)
    missing = [k for k, v in places.items() if not v]
    if missing:
        raise RuntimeError(f"checkpoint: no place in the whole model for {', '.join(missing[:3])}")
    return places


def place_views(piece: torch.Tensor, whole: torch.Tensor, how: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(the part of `piece`, the part of `whole`) that one place says are the same elements: views, so
    that copying one into the other writes the piece (loading) or the whole (putting a checkpoint together)."""
    if how[0] == "scalar":  # a step count
        return piece, whole
    if how[0] == "flat":
        _, src, dst, n = how
        return piece.view(-1)[src:src + n], whole.view(-1)[dst:dst + n]
    return piece[tuple(slice(*b) for b in how[2])], whole[tuple(slice(*b) for b in how[1])]


def fill_local(state: dict, places: dict, wholes: dict[str, torch.Tensor]) -> None:
    """Write this rank's pieces (`state`: model/params/optimizer, the live tensors or views of them) from
    whole tensors under the single-device names, from every place each piece has (a fused tensor's parts,
    a flat shard's parameters; a tied weight's names hold the same values)."""
    from multigpu.checkpoint_files import flat_state

    pieces = flat_state(state)
    with torch.no_grad():
        for key, found in places.items():
            for name, _, how in found:
                mine, theirs = place_views(pieces[key], wholes[name], how)
                mine.copy_(theirs)


def put_back_checkpoint_state(par, state: dict, how: dict) -> None:
    """After dcp.load wrote into `state`: make the module and optimizer hold it."""
    if how.get("local"):
        return  # loaded in place: the tensors are the live ones (or views of them)
    module, optimizer = _module_optimizer(par)
    model_sd, optim_sd = how["model_sd"], how["optim_sd"]
    for whole_name, live in how["fused"].items():
        _cut_fused(state["model"][whole_name], [model_sd[live[p]] for p in "qkv"])
        if whole_name in state["optimizer"]:
            for k, value in state["optimizer"][whole_name].items():
                if value.dim():
                    _cut_fused(value, [optim_sd["state"][live[p]][k] for p in "qkv"])
                else:
                    for p in "qkv":
                        optim_sd["state"][live[p]][k].copy_(value)
    set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _make_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the optimizer's state (zeros) as its first step would, for dcp.load to fill:
    torch's own helper steps once with zero gradients and a learning rate of 0, which changes no weight.
    It does nothing where a gradient exists (the from-scratch ZeRO keeps its shards' gradient tensors
    attached for good): those are set aside meanwhile and put back."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    _init_optim_state(optimizer)
    for p, grad in zip(params, grads):
        p.grad = grad


def checkpoint_targets(par, rank: int) -> tuple[dict, dict]:
    """The state dict dcp.load fills: this rank's live tensors under the saved names (the optimizer's
    state made first, as its first step would make it, so that there is something to load into)."""
    _, optimizer = _module_optimizer(par)
    _make_optimizer_state(optimizer)
    state, how = checkpoint_state(par, rank)
    if not how.get("local"):  # fused tensors are gathered copies: load into fresh ones, cut back after
        for whole_name in how["fused"]:
            state["model"][whole_name] = torch.empty_like(state["model"][whole_name])
            for k, v in state["optimizer"].get(whole_name, {}).items():
                state["optimizer"][whole_name][k] = torch.empty_like(v)
    return state, how
