"""Pipeline parallelism with torch.distributed.pipelining (multigpu.strategies.pp).

Parity: two optimizer steps of every schedule on p processes equal the single device
running the same m micro-batches in order, each loss divided by m (`micro_batch_step`):
the losses, every gradient and every updated parameter. With an untied head they are
equal bit for bit (the schedule runs the same operations on the same micro-batches, and
`scale_grads=False` leaves the gradients alone). A tied head is summed from its two
copies once after all micro-batches, where one device adds both uses micro-batch by
micro-batch: that weight (and only it) differs in the last bits. The workers live in
spmd.pp_library_checks (tests/spmd/); each launch costs seconds, so one launch runs every case.
"""

from __future__ import annotations

import pytest
import torch

from multigpu.spmd import run_spmd
from multigpu.strategies.pp import SCHEDULES, config_problems, stage_indices, traced_split
from spmd.pp_library_checks import build

CHECKS = "spmd.pp_library_checks:several"
TOLERANCE = 1e-6
TIED = {"wte.weight", "lm_head.weight"}


def assert_parity(results: list[list[dict]], cases: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        assert [r["case"] for r in per_rank] == cases
        for r in per_rank:
            where = f"rank {rank}, case {r['case']}"
            assert r["names_match"], where
            assert r["max_loss_diff"] <= TOLERANCE, (where, r)
            assert r["max_grad_diff"] <= TOLERANCE, (where, r)
            assert r["max_param_diff"] <= TOLERANCE, (where, r)
            if r["case"].get("dtype") is not None:
                continue
            assert r["losses"][0] == r["ref_losses"][0], (where, r)  # the first step starts equal
            if not r["case"].get("tied", True):  # untied: bit for bit, every step
                assert r["losses_equal"] and r["grads_bitwise"] and r["params_bitwise"], (where, r)
            elif len(r["losses"]) == 1:  # tied, one step: all but the tied weight bit for bit
                assert r["bitwise_except_tied"], (where, r)


def cases_for(p: int, model: str) -> list[dict]:
    cases = []
    for name, schedule in SCHEDULES.items():
        stages = p * schedule.stages_per_rank
        for tied in (True, False):
            cases.append({"strategy": name, "m": max(2 * p, stages), "model": model, "tied": tied})
    return cases


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_schedule_matches_single_device_on_2_ranks():
    cases = cases_for(2, "gpt-mini") + [
        {"strategy": "pp-gpipe", "m": 1, "model": "gpt-mini", "tied": True},  # GPipe takes m < p
        {"strategy": "pp-1f1b", "m": 4, "model": "gpt-mini", "tied": True, "dtype": "bf16"},
        {"strategy": "pp-zbv", "m": 4, "model": "gpt-mini", "tied": True, "dtype": "bf16"},
    ]
    [parity] = zip(*run_spmd(CHECKS, 2, calls=[("parity", dict(cases=cases))]))
    assert_parity(list(parity), cases)
    reports = [r[0]["report"] for r in parity]
    assert [rep["stages_on_this_rank"] for rep in reports] == [[0], [1]]
    zbv = [next(c for c in per_rank if c["case"]["strategy"] == "pp-zbv")["report"] for per_rank in parity]
    assert [rep["stages_on_this_rank"] for rep in zbv] == [[0, 3], [1, 2]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_schedule_matches_single_device_on_4_ranks():
    cases = cases_for(4, "deep") + [{"strategy": "pp-gpipe", "m": 2, "model": "deep", "tied": True}]
    [parity] = zip(*run_spmd(CHECKS, 4, calls=[("parity", dict(cases=cases, steps=1))]))
    assert_parity(list(parity), cases)
    interleaved = [next(c for c in per_rank if c["case"]["strategy"] == "pp-interleaved")["report"]
                   for per_rank in parity]
    assert [rep["stages_on_this_rank"] for rep in interleaved] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _cfg(strategy, world_size=2, m=4, model="gpt-mini", **kw):
    from multigpu.config import RunConfig

    return RunConfig(strategy=strategy, world_size=world_size, grad_accum_steps=m, model=model, **kw)


def test_config_problems():
    assert config_problems(_cfg("pp-1f1b", 2, 2)) == []
    assert config_problems(_cfg("pp-gpipe", 4, 1)) == []  # GPipe accepts fewer micro-batches than stages
    [msg] = config_problems(_cfg("pp-1f1b", 4, 2))
    assert "grad_accum_steps=2 < 4 stages" in msg and "use grad_accum_steps >= 4" in msg
    [msg] = config_problems(_cfg("pp-dualpipev", 2, 2))
    assert "2 < 4 stages" in msg
    [msg] = config_problems(_cfg("pp-interleaved", 4, 8))  # 8 stages, gpt-mini has 4 blocks
    assert "8 stages" in msg and "it has 4 blocks" in msg
    [msg] = config_problems(_cfg("pp-gpipe", 2, 2, model="t5-tiny"))
    assert "gpt-* preset" in msg


def test_too_few_micro_batches_are_refused_before_any_process_starts():
    """The one check of m against the schedule (prepare trusts it): inside the workers, a
    schedule that needs m >= stages would raise or hang."""
    from multigpu.config import ConfigError

    with pytest.raises(ConfigError, match="at least as many micro-batches as stages"):
        _cfg("pp-1f1b", 2, 1).validate()
    with pytest.raises(ConfigError, match="grad_accum_steps=2 < 4 stages"):
        _cfg("pp-dualpipev", 2, 2).validate()


def test_v_placement_is_the_librarys():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for p in (1, 2, 4):
        for name, schedule in SCHEDULES.items():
            style = schedule.placement
            expected = generate_stage_to_rank_mapping(p, p * schedule.stages_per_rank, style=style)
            mine = {s: r for r in range(p) for s in stage_indices(schedule, r, p)}
            assert mine == expected, (name, p)


def test_traced_split():
    out = traced_split()  # 4 x (Linear, Tanh), cut before the third Linear
    assert out["num_stages"] == 2 and out["matches_whole_model"]
    assert out["parameters"] == [["0.weight", "0.bias", "2.weight", "2.bias"],
                                 ["4.weight", "4.bias", "6.weight", "6.bias"]]
    model = build("gpt-mini", tied=False)
    out = traced_split(model, torch.randint(0, 512, (2, 16)), ("blocks.2",))
    assert out["num_stages"] == 2 and out["matches_whole_model"]
    assert "wte.weight" in out["parameters"][0] and "lm_head.weight" in out["parameters"][1]
