"""Collectives built from send and receive must equal the library's, and send the bytes
their formulas say; the collective demo must show what each collective is defined to do.

Reference: `torch.distributed.all_reduce` on the same inputs, and the textbook definitions
(computed here in plain Python). Runs on 2 to 8 gloo processes."""

from __future__ import annotations

import pytest

from multigpu.collectives import ALL_REDUCES, ring_all_reduce_steps
from multigpu.config import ConfigError
from multigpu.spmd import run_spmd

# sizes divisible by no world size tested, by some, and smaller than the world
SIZES = [1, 3, 1000, 1001]


@pytest.fixture(scope="module", params=[2, 3, 4, 8])
def compared(request):
    n = request.param
    return n, run_spmd("multigpu.collectives:compare_with_library", n, sizes=SIZES,
                       dtypes=["float32", "bfloat16"], timeout_s=300)


@pytest.mark.slow
def test_from_scratch_all_reduces_equal_the_library(compared):
    """Whole numbers add up exactly in any order, so there the results must be identical;
    random values agree up to the rounding of another summation order."""
    n, per_rank = compared
    rows = [row for rank_rows in per_rank for row in rank_rows]
    assert {r["algorithm"] for r in rows} == set(ALL_REDUCES)
    assert {(r["size"], r["dtype"]) for r in rows} == {(s, d) for s in SIZES for d in ("float32", "bfloat16")}
    for r in rows:
        if r["input"] == "whole numbers":
            assert r["max_abs_diff"] == 0, r
        else:  # a few units in the last place of sums of n standard normals
            assert r["max_abs_diff"] <= (1e-5 if r["dtype"] == "float32" else 0.25), r


@pytest.mark.slow
def test_every_rank_ends_with_the_same_bits(compared):
    """An all-reduce must leave every rank identical (random inputs: the summation order
    matters, so each algorithm must add in one order on every rank)."""
    n, per_rank = compared
    for case in zip(*per_rank):  # the same (algorithm, size, dtype, input) on each rank
        assert len({row["digest"] for row in case}) == 1, case[0]


@pytest.mark.slow
def test_bytes_sent_follow_the_formulas(compared):
    """Naive: N-1 copies from every rank. Parameter server: N-1 copies from the server, one
    from each worker. Ring: 2(N-1) chunks, i.e. 2(N-1)/N of the data (chunks round up)."""
    n, per_rank = compared
    for rank, rank_rows in enumerate(per_rank):
        for r in rank_rows:
            data = r["size"] * (4 if r["dtype"] == "float32" else 2)
            element = data // r["size"]
            if r["algorithm"] == "library":
                assert r["sent_bytes"] is None  # the library does not say; the loopback measures it
            elif r["algorithm"] == "naive":
                assert r["sent_bytes"] == (n - 1) * data
            elif r["algorithm"] == "parameter server":
                assert r["sent_bytes"] == ((n - 1) * data if rank == 0 else data)
            elif r["algorithm"] == "ring":
                largest_chunk = -(-r["size"] // n) * element
                assert 2 * (n - 1) * (r["size"] // n) * element <= r["sent_bytes"] <= 2 * (n - 1) * largest_chunk
                if r["size"] % n == 0:
                    assert r["sent_bytes"] == 2 * (n - 1) * data // n


@pytest.mark.slow
def test_demo_shows_each_collective_by_its_definition():
    n = 4
    per_rank = run_spmd("multigpu.collectives:demo", n)
    x = [[10 * (r + 1) + c for c in range(n)] for r in range(n)]  # what rank r starts with
    total = [sum(x[r][c] for r in range(n)) for c in range(n)]
    expected = {
        "broadcast (from rank 0)": [x[0]] * n,
        "reduce (to rank 0)": [total] + [None] * (n - 1),
        "all-reduce": [total] * n,
        "reduce-scatter": [[total[r]] for r in range(n)],
        "all-gather": [[x[q][0] for q in range(n)]] * n,
        "all-to-all": [[x[q][r] for q in range(n)] for r in range(n)],
        "send / recv (to the right)": [x[(r - 1) % n] for r in range(n)],
    }
    names = [row["collective"] for row in per_rank[0]]
    assert names == list(expected)
    for i, name in enumerate(names):
        assert [per_rank[r][i]["after"] for r in range(n)] == expected[name], name


def test_ring_simulation_sends_2_n_minus_1_chunks_and_sums():
    for n in (2, 3, 5):
        values = [[float(10 * r + c) for c in range(n)] for r in range(n)]
        history = ring_all_reduce_steps(values)
        total = [sum(values[r][c] for r in range(n)) for c in range(n)]
        assert history[-1]["state"] == [total] * n
        assert history[-1]["sent_chunks"] == [2 * (n - 1)] * n


def test_run_spmd_refuses_bad_input_clearly():
    with pytest.raises(ConfigError, match="module:function"):
        run_spmd("multigpu.collectives", 2)
    with pytest.raises(ConfigError, match="module:function"):
        run_spmd("no.such.module:f", 2)
    with pytest.raises(ConfigError, match="must pickle"):
        run_spmd("multigpu.collectives:demo", 2, bad=lambda: None)
    with pytest.raises(ConfigError, match="module:function"):
        run_spmd("multigpu.collectives:no_such_function", 2)
    with pytest.raises(ConfigError, match="world_size"):
        run_spmd("multigpu.collectives:demo", 0)


@pytest.mark.slow
def test_a_failing_rank_is_reported_not_hung():
    from multigpu.launch import LaunchError

    with pytest.raises(LaunchError, match="ValueError: unknown algorithm"):
        run_spmd("multigpu.collectives:benchmark", 2, sizes=[64], algorithms=["no such algorithm"], timeout_s=120)
