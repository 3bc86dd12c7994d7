"""Parity checks for pipeline parallelism from scratch (multigpu.strategies.pp_scratch).

`schedule_checks` runs inside a process group of p ranks, one pipeline stage each, via
`multigpu.spmd.run_spmd("spmd.pp_checks:schedule_checks", p)` (tests/test_pp_scratch.py).
Every rank builds the same model and micro-batches from one seed, runs the plain reference
(one process, the micro-batches in order, each loss divided by m) and one training step of
each schedule, and returns the differences, whether they were zero, and the schedule's event
log, so that the test can judge them.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from multigpu.models import GPT, GPT_SIZES
from multigpu.runtime import RankGrid
from multigpu.strategies import pp_scratch


def _model(n_layer: int, tied: bool, seed: int) -> GPT:
    """gpt-tiny with n_layer blocks (2 is gpt-tiny itself), tied or untied head."""
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(GPT_SIZES["gpt-tiny"], n_layer=n_layer, tie_embeddings=tied))


def _micro_batches(vocab: int, m: int, batch: int, seq: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen),
             "labels": torch.randint(0, vocab, (batch, seq), generator=gen)} for _ in range(m)]


def _grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its state-dict name (a tied weight under both)."""
    return {name: t.grad.detach().clone() for name, t in model.state_dict(keep_vars=True).items()
            if t.grad is not None}


def _reference(n_layer, tied, seed, micro_batches, lr, autocast_dtype=None):
    """One process: each micro-batch's loss/m, backward in order; then one SGD step."""
    model = _model(n_layer, tied, seed)
    m, loss = len(micro_batches), 0.0
    for batch in micro_batches:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            part = model(**batch) / m
        part.backward()
        loss += part.item()
    grads = _grads(model)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return loss, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(ours: dict, ref: dict) -> float:
    return max((ours[k] - ref[k]).abs().max().item() for k in ours if k in ref)


def _one(schedule, n_layer, tied, seed, micro_batches, lr, grid, reference, autocast_dtype=None) -> dict:
    ref_loss, ref_grads, ref_weights = reference
    model = _model(n_layer, tied, seed)
    cfg = SimpleNamespace(strategy=schedule, optimizer="sgd", lr=lr, grad_accum_steps=len(micro_batches))
    par = pp_scratch.prepare(model, cfg, SimpleNamespace(grid=grid))
    start = time.perf_counter()
    loss = par.run_step(micro_batches, autocast_dtype)
    seconds = time.perf_counter() - start
    grads = _grads(model)  # this stage's parameters: the step leaves .grad in place
    weights = par.full_state_dict()
    report = par.report()
    return {
        "loss": loss, "ref_loss": ref_loss, "loss_diff": abs(loss - ref_loss),
        "grad_names": sorted(grads), "names_known": set(grads) <= set(ref_grads),
        "grad_diff": _max_diff(grads, ref_grads),
        "not_bitwise": sorted(k for k in grads if not torch.equal(grads[k], ref_grads[k])),
        "weights_diff": _max_diff(weights, ref_weights), "weight_names_match": set(weights) == set(ref_weights),
        "events": report["events"], "peak_in_flight": report["peak_in_flight"], "stage": report["stage"],
        "step_s": seconds,
    }


def schedule_checks(n_layer: int = 2, ms=(1, 2, 4), schedules=tuple(pp_scratch.SCHEDULES), batch: int = 2,
                    seq: int = 16, seed: int = 0, lr: float = 0.1) -> dict:
    """For tied and untied heads, each m in `ms` and each schedule: one step on this stage
    against the reference. Keys "<schedule>/m<m>/<tied|untied>"; also "bf16" (1F1B under bf16
    autocast, m=2)."""
    p = dist.get_world_size()
    grid = RankGrid.build("cpu", pp=p)
    vocab = GPT_SIZES["gpt-tiny"].vocab_size
    out = {}
    for tied in (True, False):
        for m in ms:
            micro_batches = _micro_batches(vocab, m, batch, seq, seed + m)
            reference = _reference(n_layer, tied, seed, micro_batches, lr)
            for schedule in schedules:
                key = f"{schedule}/m{m}/{'tied' if tied else 'untied'}"
                out[key] = _one(schedule, n_layer, tied, seed, micro_batches, lr, grid, reference)
    micro_batches = _micro_batches(vocab, 2, batch, seq, seed)
    reference = _reference(n_layer, True, seed, micro_batches, lr, torch.bfloat16)
    out["bf16"] = _one("pp-1f1b-scratch", n_layer, True, seed, micro_batches, lr, grid, reference, torch.bfloat16)
    return out
