"""Pipeline parallelism from scratch (multigpu.strategies.pp_scratch) against one device.

The schedules are plain lists of actions, tested without processes. The parity checks run in
`spmd.pp_checks` (tests/spmd/) on 2 and 4 gloo processes (one launch per p, shared by the tests below):
one step of every schedule, m in {1, 2, 4}, tied and untied head, against one process running
the same micro-batches in order with loss/m each. A pipeline runs the very same operations in
the same order, so the gradients are equal bit for bit; only a tied weight's gradient is
summed in another order (each stage sums its share over the micro-batches, then the two
shares are added), so it agrees to rounding.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import pytest

from multigpu.config import STRATEGY_TABLE, ConfigError, RunConfig
from multigpu.spmd import run_spmd
from multigpu.strategies.pp_scratch import SCHEDULES, config_problems, gpipe, naive, one_f_one_b

TOLERANCE = 1e-6
TIED = {"wte.weight", "lm_head.weight"}  # summed over two stages: not bitwise, within rounding


def _in_flight_peak(actions) -> int:
    live = peak = 0
    for action, _ in actions:
        live += 1 if action == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p", [1, 2, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_schedules_run_every_micro_batch_once_in_order(p, m):
    for schedule in (naive, gpipe, one_f_one_b):
        for stage in range(p):
            actions = schedule(stage, p, m)
            forwards = [i for a, i in actions if a == "F"]
            backwards = [i for a, i in actions if a == "B"]
            # in micro-batch order, both: one device's gradient sums in that order too
            assert forwards == backwards == list(range(m)), (schedule.__name__, stage, actions)
            assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))
    assert all(_in_flight_peak(naive(s, p, m)) == 1 for s in range(p))
    assert all(_in_flight_peak(gpipe(s, p, m)) == m for s in range(p))
    assert [_in_flight_peak(one_f_one_b(s, p, m)) for s in range(p)] == [min(p - s, m) for s in range(p)]


def test_one_f_one_b_warm_up_steady_cool_down():
    # p=4, m=6, stage 1: 2 forwards ahead, then alternate, then drain (Megatron-LM 2021, fig. 4)
    assert one_f_one_b(1, 4, 6) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4),
                                    ("B", 2), ("F", 5), ("B", 3), ("B", 4), ("B", 5)]
    assert one_f_one_b(3, 4, 2) == naive(3, 4, 2)  # the last stage has no warm-up
    assert one_f_one_b(0, 4, 2) == gpipe(0, 4, 2)  # m < p: all warm-up


def _cfg(model="gpt-tiny", pp=2, dp=1, tp=1):
    return SimpleNamespace(model=model, degrees={"dp": dp, "pp": pp, "tp": tp})


def test_config_problems():
    assert config_problems(_cfg(pp=2)) == []
    assert config_problems(_cfg("gpt-mini", pp=4)) == []
    (too_many,) = config_problems(_cfg(pp=4))
    assert "4 stages" in too_many and "2 blocks" in too_many and "at most 2" in too_many, too_many
    (t5,) = config_problems(_cfg("t5-tiny"))
    assert "t5" in t5 and "gpt-" in t5


@pytest.mark.parametrize("strategy", list(SCHEDULES))
def test_run_config_refuses_dp_and_tp(strategy):
    """Stages only: nothing here averages over replicas or cuts layers. The grid's rule says so
    before any process starts (prepare trusts it)."""
    with pytest.raises(ConfigError, match="pipeline parallel only: it does not take dp=2"):
        RunConfig(strategy=strategy, world_size=4, model="gpt-mini", grad_accum_steps=4, dp=2).validate()
    with pytest.raises(ConfigError, match="does not combine with tp"):
        RunConfig(strategy=strategy, world_size=4, model="gpt-mini", grad_accum_steps=4, tp=2).validate()


@pytest.mark.skipif("pp-1f1b-scratch" not in STRATEGY_TABLE, reason="the pipeline strategies are not in the table yet")
@pytest.mark.parametrize("strategy", list(SCHEDULES))
def test_run_config_refuses_more_stages_than_blocks(strategy):
    with pytest.raises(ConfigError, match="4 stages cannot split gpt-tiny's 2 blocks"):
        RunConfig(strategy=strategy, world_size=4, model="gpt-tiny", grad_accum_steps=4).validate()


def _schedule_and_m(key: str) -> tuple[str, int]:
    """"pp-naive/m4/tied" -> ("pp-naive", 4); "bf16" is 1F1B with m=2."""
    if key == "bf16":
        return "pp-1f1b-scratch", 2
    schedule, m, _ = key.split("/")
    return schedule, int(m[1:])


@cache
def checks(p: int) -> list[dict]:
    # p=2: gpt-tiny itself; p=4: gpt-tiny with 4 blocks, one per stage
    return run_spmd("spmd.pp_checks:schedule_checks", p, n_layer=2 if p == 2 else 4)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 4])
def test_schedules_match_single_device(p):
    results = checks(p)
    for rank, result in enumerate(results):
        assert len(result) == 3 * 3 * 2 + 1
        for key, got in result.items():
            where = (rank, key)
            assert got["stage"] == rank
            assert got["names_known"] and got["weight_names_match"], where
            assert got["loss"] == results[-1][key]["loss"], where  # every stage reports the last's loss
            assert got["grad_diff"] <= TOLERANCE and got["weights_diff"] <= TOLERANCE, (where, got)
            # the same operations in the same order (bf16 autocast included): the same bits
            assert got["loss_diff"] == 0.0, (where, got["loss_diff"])
            assert set(got["not_bitwise"]) <= (set() if key.endswith("/untied") else TIED), (where, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 4])
def test_event_log(p):
    for rank, result in enumerate(checks(p)):
        for key, got in result.items():
            schedule, m = _schedule_and_m(key)
            events = got["events"]
            assert all(e["stage"] == rank for e in events)
            for action in "FB":
                assert sorted(e["micro"] for e in events if e["action"] == action) == list(range(m)), (rank, key)
            # the log is the schedule, in order
            order = [(e["action"], e["micro"]) for e in events if e["action"] in "FB"]
            assert order == SCHEDULES[schedule](rank, p, m), (rank, key)
            for before, after in zip(events, events[1:]):  # one stage does one thing at a time
                assert 0 <= before["start_s"] <= before["end_s"] <= after["start_s"], (rank, key)
            peak = {"pp-naive": 1, "pp-gpipe-scratch": m, "pp-1f1b-scratch": min(p - rank, m)}[schedule]
            assert got["peak_in_flight"] == peak, (rank, key)
            sends = [e for e in events if e["action"] not in "FB"]
            # every micro-batch's activation goes forward once and its gradient back once
            assert len([e for e in sends if "send_forward" in e["action"]]) == (m if rank < p - 1 else 0)
            assert len([e for e in sends if "send_backward" in e["action"]]) == (m if rank > 0 else 0)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif("pp-1f1b-scratch" not in STRATEGY_TABLE, reason="the pipeline strategies are not in the table yet")
def test_training_loop_matches_single():
    """Through the shared loop: 3 steps of 1F1B on 2 stages, 4 micro-batches, against `single`."""
    from multigpu.check import check

    result = check("pp-1f1b-scratch", 2, steps=3, tolerance=1e-5, grad_accum_steps=4)
    assert result["passed"], result
