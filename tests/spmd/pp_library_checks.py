"""SPMD checks of multigpu.strategies.pp (torch.distributed.pipelining), for tests/test_pp_library.py.

    run_spmd("spmd.pp_library_checks:parity", 2, cases=[{"strategy": "pp-1f1b", "m": 4}])

Every rank builds the single-device model from the same seed and trains it with the plain
micro-batch step (`micro_batch_step`: the same m micro-batches in order, each loss divided
by m): the reference. Then it builds the model again, cuts it into pipeline stages through
the strategy's own `prepare`, and trains the same steps with the schedule. We report the
loss of every step, and after the last step every gradient and every updated parameter,
gathered whole from all stages: their largest differences, and whether they are equal bit
for bit.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import torch
import torch.distributed as dist

from multigpu.models import GPT, GPT_SIZES, GPTConfig
from multigpu.strategies import Parallelized, build_optimizer, micro_batch_step

# "gpt-mini" (4 blocks), or "deep": 8 small blocks, enough for 2 stages per rank on 4 ranks
TIED = {"wte.weight", "lm_head.weight"}  # the weight a tied head shares with the embedding
MODELS = {"gpt-mini": GPT_SIZES["gpt-mini"],
          "deep": GPTConfig(vocab_size=128, n_layer=8, n_head=4, d_model=64, seq_len=64)}


def build(model: str = "gpt-mini", tied: bool = True, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(MODELS[model], tie_embeddings=tied))


def micro_batches(vocab: int, m: int, micro: int, seq_len: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, vocab, (micro, seq_len + 1), generator=g)
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def _diff(a: dict, b: dict) -> tuple[float, str | None, bool]:
    """(largest |a - b|, the name where it is, every tensor equal bit for bit)."""
    worst, where = 0.0, None
    for k, v in b.items():
        d = (a[k].float() - v.float()).abs().max().item()
        if d > worst or where is None:
            worst, where = d, k
    return worst, where, all(torch.equal(a[k], v) for k, v in b.items())


def parity(cases: list[dict], micro: int = 2, seq_len: int = 16, lr: float = 0.1, steps: int = 2,
           seed: int = 0) -> list[dict]:
    """For each case {"strategy", "m", "model" ("gpt-mini" | "deep"), "tied", "dtype" (None | "bf16")}:
    {case, losses, ref_losses, losses_equal, max_grad_diff, worst_grad, grads_bitwise,
    max_param_diff, worst_param, params_bitwise, report, names_match}."""
    from multigpu.runtime import RankGrid
    from multigpu.strategies.pp import prepare

    world = dist.get_world_size()
    rt = SimpleNamespace(grid=RankGrid.build("cpu", pp=world), device=torch.device("cpu"),
                         world_size=world, rank=dist.get_rank())
    results = []
    for case in cases:
        m = case["m"]
        autocast = torch.bfloat16 if case.get("dtype") == "bf16" else None
        cfg = SimpleNamespace(strategy=case["strategy"], grad_accum_steps=m, optimizer="sgd", lr=lr, extra={},
                              activation_checkpointing=False, world_size=world)
        base = build(case.get("model", "gpt-mini"), case.get("tied", True), seed)
        data = [micro_batches(base.cfg.vocab_size, m, micro, seq_len, seed + 1 + s) for s in range(steps)]

        ref = copy.deepcopy(base)
        ref_par = Parallelized(module=ref, optimizer=build_optimizer(ref.parameters(), cfg), model=ref)
        ref_losses = [micro_batch_step(ref_par, batches, autocast) for batches in data]
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        if ref.cfg.tie_embeddings:  # the pipeline holds the tied weight twice: both copies must match
            ref_grads["lm_head.weight"] = ref_grads["wte.weight"]
        ref_state = ref.state_dict()

        par = prepare(copy.deepcopy(base), cfg, rt)
        losses = [par.run_step(batches, autocast) for batches in data]
        mine = {n: p.grad.clone() for s in par.module for n, p in s.piece.named_parameters()}
        parts = [None] * world
        dist.all_gather_object(parts, mine)
        grads = {k: v for part in parts for k, v in part.items()}
        if base.cfg.tie_embeddings and "lm_head.weight" not in grads:  # one stage holds both uses
            grads["lm_head.weight"] = grads["wte.weight"]
        state = par.full_state_dict()
        grad_diff, worst_grad, grads_bitwise = _diff(grads, ref_grads)
        param_diff, worst_param, params_bitwise = _diff(state, ref_state)
        results.append({
            "case": case,
            "losses": losses,
            "ref_losses": ref_losses,
            "losses_equal": losses == ref_losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "max_grad_diff": grad_diff, "worst_grad": worst_grad, "grads_bitwise": grads_bitwise,
            "max_param_diff": param_diff, "worst_param": worst_param, "params_bitwise": params_bitwise,
            "bitwise_except_tied": all(torch.equal(grads[k], v) for k, v in ref_grads.items() if k not in TIED)
            and all(torch.equal(state[k], v) for k, v in ref_state.items() if k not in TIED),
            "names_match": set(state) == set(ref_state) and set(grads) == set(ref_grads),
            "report": par.report(),
        })
    return results


def several(calls: list[tuple[str, dict]]) -> list:
    """Run several checks in one launch: [(function name, kwargs), ...] -> their results."""
    return [globals()[name](**kwargs) for name, kwargs in calls]
