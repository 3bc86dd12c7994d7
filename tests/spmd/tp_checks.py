"""Parity checks for tensor parallelism from scratch (multigpu.strategies.tp_scratch).

Each function runs inside a process group of tp ranks, via
`multigpu.spmd.run_spmd("spmd.tp_checks:<name>", tp)` (tests/test_tp_layers.py), builds the
same tensors on every rank from one seed, runs a layer on one process's worth of data the
plain way and the tensor-parallel way, and returns the largest absolute differences (plus
what was counted), so that the test can judge them.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from multigpu.comm import CommCounter
from multigpu.models import GPT_SIZES, MLP, apply_activation_checkpointing, build_model
from multigpu.runtime import RankGrid
from multigpu.strategies import tp_scratch as tp_
from multigpu.strategies.state import sliced_grads


def _diff(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _mine(x, dim):
    """This rank's 1/tp of x along dim."""
    return x.detach().chunk(dist.get_world_size(), dim)[dist.get_rank()]


def _leaf(x):
    return x.detach().clone().requires_grad_()


def layer_checks(seed: int = 0) -> dict[str, float]:
    """Column, row, the MLP (with and without SP), the vocabulary-parallel embedding and loss,
    each against its single-device version: largest absolute difference per quantity."""
    group, out = dist.group.WORLD, {}
    torch.manual_seed(seed)  # the same "full" tensors on every rank

    x, lin = torch.randn(2, 8, 16, requires_grad=True), nn.Linear(16, 24)
    ref = lin(x)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    col, xc = tp_.ColumnParallelLinear(copy.deepcopy(lin), group), _leaf(x)
    y = col(xc)
    y.backward(_mine(dy, -1))
    out |= {"column.out": _diff(y, _mine(ref, -1)), "column.input_grad": _diff(xc.grad, x.grad),
            "column.weight_grad": _diff(col.weight.grad, _mine(lin.weight.grad, 0)),
            "column.bias_grad": _diff(col.bias.grad, _mine(lin.bias.grad, 0))}

    x, lin = torch.randn(2, 8, 24, requires_grad=True), nn.Linear(24, 16)
    ref = lin(x)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    row, xr = tp_.RowParallelLinear(copy.deepcopy(lin), group), _leaf(_mine(x, -1))
    y = row(xr)
    y.backward(dy)
    out |= {"row.out": _diff(y, ref), "row.input_grad": _diff(xr.grad, _mine(x.grad, -1)),
            "row.weight_grad": _diff(row.weight.grad, _mine(lin.weight.grad, 1)),
            "row.bias_grad": _diff(row.bias.grad, lin.bias.grad)}

    mlp = MLP(GPT_SIZES["gpt-tiny"].d_model, GPT_SIZES["gpt-tiny"].d_ff)
    x = torch.randn(2, 8, 64, requires_grad=True)
    ref = mlp(x)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    for sp in (False, True):
        par = copy.deepcopy(mlp)
        par.zero_grad()
        par.fc, par.proj = tp_.ColumnParallelLinear(par.fc, group, sp), tp_.RowParallelLinear(par.proj, group, sp)
        xm = _leaf(_mine(x, 1) if sp else x)  # under SP the input is this rank's positions
        y = par(xm)
        y.backward(_mine(dy, 1) if sp else dy)
        tp_.sync_sequence_parallel_grads(par, group)  # proj.bias under SP
        name = "mlp+sp" if sp else "mlp"
        out |= {f"{name}.out": _diff(y, _mine(ref, 1) if sp else ref),
                f"{name}.input_grad": _diff(xm.grad, _mine(x.grad, 1) if sp else x.grad),
                f"{name}.fc_grad": _diff(par.fc.weight.grad, _mine(mlp.fc.weight.grad, 0)),
                f"{name}.proj_grad": _diff(par.proj.weight.grad, _mine(mlp.proj.weight.grad, 1)),
                f"{name}.proj_bias_grad": _diff(par.proj.bias.grad, mlp.proj.bias.grad)}

    # embedding -> head -> loss, vocabulary cut; one label ignored as F.cross_entropy does
    emb, head = nn.Embedding(32, 16), nn.Linear(16, 32, bias=False)
    ids = torch.randint(0, 32, (2, 8))
    labels = torch.randint(0, 32, (2, 8))
    labels[0, 0] = -100
    loss = F.cross_entropy(head(emb(ids)).flatten(0, 1), labels.flatten())
    loss.backward()
    for sp in (False, True):
        pe = tp_.VocabParallelEmbedding(copy.deepcopy(emb), group, sp)
        ph = tp_.ColumnParallelLinear(copy.deepcopy(head), group, sp)
        ploss = tp_.vocab_parallel_cross_entropy(ph(pe(ids)), labels, group)
        ploss.backward()
        name = "vocab+sp" if sp else "vocab"
        out |= {f"{name}.loss": _diff(ploss, loss),
                f"{name}.embedding_grad": _diff(pe.weight.grad, _mine(emb.weight.grad, 0)),
                f"{name}.head_grad": _diff(ph.weight.grad, _mine(head.weight.grad, 0))}

    # the loss alone on large logits: the max shift must keep exp() finite
    logits = (30 * torch.randn(64, 32)).requires_grad_()
    labels = torch.randint(0, 32, (64,))
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    mine = _leaf(_mine(logits, -1))
    ploss = tp_.vocab_parallel_cross_entropy(mine, labels, group)
    ploss.backward()
    out |= {"cross_entropy.loss": _diff(ploss, loss), "cross_entropy.grad": _diff(mine.grad, _mine(logits.grad, -1))}
    return out


def _batch(cfg, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen),
            torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen))


def gpt_checks(model: str = "gpt-tiny", batch: int = 2, seq: int = 16, seed: int = 0) -> dict:
    """The whole GPT: one forward and backward, plain on one rank's copy and tensor-parallel,
    as plain TP, TP+SP and TP+SP under activation checkpointing. For each: loss and largest
    gradient difference, whether the gathered names match, and the collectives counted in
    forward and in backward. Then two optimizer steps through `prepare` (TP+SP, checkpointed,
    SGD) against two plain steps, and the error a sequence tp does not divide gives."""
    group, tp = dist.group.WORLD, dist.get_world_size()
    ref = build_model(model, seed=seed)
    ids, labels = _batch(ref.cfg, batch, seq, seed)
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in ref.state_dict(keep_vars=True).items()}
    out = {"n_layer": ref.cfg.n_layer}
    for variant in ("tp", "tp+sp", "tp+sp+ac"):
        plain = build_model(model, seed=seed)
        if variant.endswith("+ac"):
            apply_activation_checkpointing(plain)
        par = tp_.parallelize(plain, group, sequence_parallel="sp" in variant)
        with CommCounter(tp) as forward:
            loss = par(ids, labels)
        with CommCounter(tp) as backward:
            loss.backward()
        tp_.sync_sequence_parallel_grads(plain, group)
        grads = sliced_grads(plain, group)
        out[variant] = {
            "tied": plain.lm_head.weight is plain.wte.weight,
            "loss": _diff(loss, ref_loss),
            "grad": max(_diff(grads[n], ref_grads[n]) for n in ref_grads),
            "names_match": list(grads) == list(ref_grads),
            "forward": dict(forward.calls), "backward": dict(backward.calls),
        }

    cfg = SimpleNamespace(optimizer="sgd", lr=0.5, extra={"sequence_parallel": True})
    rt = SimpleNamespace(grid=RankGrid.build("cpu", tp=tp))
    ref, plain = build_model(model, seed=seed), apply_activation_checkpointing(build_model(model, seed=seed))
    ref_opt, par = torch.optim.SGD(ref.parameters(), lr=cfg.lr), tp_.prepare(plain, cfg, rt)
    losses = []
    for step in range(2):
        ids, labels = _batch(ref.cfg, batch, seq, seed + 1 + step)
        ref_opt.zero_grad()
        ref(ids, labels).backward()
        ref_opt.step()
        par.zero_grad()
        loss = par.module(ids, labels)
        par.backward(loss)
        par.step()
        losses.append(loss.item())
    state, ref_state = par.full_state_dict(), ref.state_dict()
    out["prepare"] = {"weights": max(_diff(state[n], ref_state[n]) for n in ref_state),
                      "names_match": list(state) == list(ref_state), "losses": losses}
    try:  # a sequence of tp + 1 tokens does not split over tp ranks
        sp_model = tp_.parallelize(build_model(model, seed=seed), group, sequence_parallel=True)
        sp_model(ids[:, :tp + 1], labels[:, :tp + 1])
    except ValueError as err:
        out["sp_error"] = str(err)
    return out
