"""The ZeRO trace (multigpu.experiments.step_traces.zero_holdings) against the stages' definitions: between
steps a rank holds what the ZeRO formula says, the shards cover the model once, stage 3
gathers one block at a time (twice per step) and frees it, and stage 2 never holds more
than two shards of gradients."""

import pytest

from multigpu.experiments.step_traces import held_bytes, union
from multigpu.memory import zero_model_states
from multigpu.spmd import run_spmd


@pytest.fixture(scope="module")
def traces():
    by_rank = run_spmd("multigpu.experiments.step_traces:zero_holdings", 2)
    return {stage: [rank[i] for rank in by_rank] for i, stage in enumerate((1, 2, 3))}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_between_steps_a_rank_holds_what_the_formula_says(traces, stage):
    for trace in traces[stage]:
        assert trace["frames"][0]["event"] == "start of the step"
        expected = zero_model_states(trace["length"], trace["world_size"], stage, "adamw")
        assert held_bytes(trace, 0) == pytest.approx(expected)
        assert held_bytes(trace, len(trace["frames"]) - 1) == held_bytes(trace, 0)  # all freed again


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_optimizer_shards_cover_the_model_once(traces, stage):
    spans = sorted(s for trace in traces[stage] for s in union(trace["frames"][0]["optimizer"]))
    assert spans[0][0] == 0 and spans[-1][1] == traces[stage][0]["length"]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap


def test_stage3_gathers_each_block_twice_one_at_a_time(traces):
    for trace in traces[3]:
        blocks = [(name, start, end) for name, start, end in trace["units"] if name.startswith("block")]
        assert len(blocks) >= 2
        for frame in trace["frames"]:
            held = union(frame["params"])
            gathered = [name for name, start, end in blocks if any(a <= start and end <= b for a, b in held)]
            assert len(gathered) <= 1, frame["event"]
        gathers = [f["event"] for f in trace["frames"] if f["event"].startswith("all-gather block")]
        assert sorted(gathers) == sorted(f"all-gather {name}" for name, _, _ in blocks * 2)


def test_stage2_holds_at_most_two_shards_of_gradients(traces):
    for trace in traces[2]:
        shard = trace["length"] // trace["world_size"] * trace["bytes_per_element"]["grads"]
        grads = [held_bytes(trace, k)["grads"] for k in range(len(trace["frames"]))]
        assert shard < max(grads) <= 2 * shard  # a bucket was seen filled, never more than a shard
        assert any(f["event"].startswith("bucket") for f in trace["frames"])
