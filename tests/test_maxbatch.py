"""The largest-batch search: against brute force on a known memory curve, and on real runs."""

from __future__ import annotations

import pytest

from multigpu import maxbatch
from multigpu.config import RunConfig


@pytest.mark.parametrize("fixed, per_sample, cap", [(100, 15, 200), (60, 10, 200), (100, 1, 150), (10, 50, 59),
                                                  (100, 15, 99), (100, 0, 10**6)])
def test_search_finds_what_brute_force_finds(monkeypatch, fixed, per_sample, cap):
    """A fake run whose peak is fixed + per_sample x batch (with a kink, as real runs have
    at small batches): the search must return the largest batch that fits, in few runs."""
    launched = []

    def fake_launch(cfg, progress=None):
        b = cfg.global_batch_size // cfg.processes
        launched.append(b)
        peak = fixed + per_sample * b - (per_sample // 2 if b == 1 else 0)
        return {"cuda_allocator_peak_bytes_by_rank": [None], "peak_memory_bytes_by_rank": [{"total": peak}],
                "provenance": {}}

    monkeypatch.setattr(maxbatch, "launch", fake_launch)
    found = maxbatch.measure_largest_batch(RunConfig(strategy="ddp", world_size=2), cap, limit=1000)
    peak = {b: fixed + per_sample * b - (per_sample // 2 if b == 1 else 0) for b in range(1, 1001)}
    expected = max((b for b in peak if peak[b] <= cap), default=0)
    assert found["per_rank_batch"] == expected
    assert found["global_batch"] == 2 * expected
    assert len(launched) <= 8, launched
    assert max(launched) <= 4 * max(expected, 1), launched  # never a batch far beyond the answer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_largest_batch_on_real_runs_is_a_boundary():
    """The answer fits the cap and one more sample per rank does not, both measured."""
    cfg = RunConfig(strategy="ddp", world_size=2, model="gpt-tiny", optimizer="adamw", dataset="dummy")
    one = maxbatch.peak_bytes(maxbatch.launch(cfg.replace(global_batch_size=2, steps=2), progress=False))
    found = maxbatch.measure_largest_batch(cfg, cap_bytes=int(one * 1.5))
    b, probes = found["per_rank_batch"], found["probes"]
    assert b >= 1 and probes[b] <= found["cap_bytes"] < probes[b + 1]


def test_runs_that_run_out_of_memory_are_bisected(monkeypatch):
    """Above a batch the device cannot hold, probes fail with out-of-memory (no peak to draw
    a line through): the search halves the gap instead of stepping one sample at a time."""
    launched = []

    def fake_launch(cfg, progress=None):
        b = cfg.global_batch_size // cfg.processes
        launched.append(b)
        if b > 20:
            raise maxbatch.LaunchError("rank 0: CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"cuda_allocator_peak_bytes_by_rank": [None], "peak_memory_bytes_by_rank": [{"total": 10 * b}],
                "provenance": {"machine_tag": "fake"}}

    monkeypatch.setattr(maxbatch, "launch", fake_launch)
    found = maxbatch.measure_largest_batch(RunConfig(strategy="ddp", world_size=2), cap_bytes=10**6, limit=1000)
    assert found["per_rank_batch"] == 20 and found["provenance"] == {"machine_tag": "fake"}
    assert len(launched) <= 10, launched
    assert found["probes"][max(launched)] is None
