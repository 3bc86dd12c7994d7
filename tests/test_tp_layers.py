"""Tensor parallelism from scratch (multigpu.strategies.tp_scratch) against one device.

The checks run in `spmd.tp_checks` (tests/spmd/) on 2 and 4 gloo processes and return the largest
differences; each launch costs a few seconds, so one launch per (checks, tp) is shared by
the tests below. A tensor-parallel layer sums in another order (a row-parallel matmul adds
tp partial sums), so results agree within float32 rounding, not bit for bit.
"""

from __future__ import annotations

from functools import cache

import pytest

from multigpu.config import ConfigError, RunConfig
from multigpu.models import GPT_SIZES
from multigpu.spmd import run_spmd
from multigpu.strategies.tp_scratch import check_divisible

TOLERANCE = 1e-5  # absolute, on quantities of order 1; measured: at most ~2e-6


@cache
def layers(tp: int) -> list[dict]:
    return run_spmd("spmd.tp_checks:layer_checks", tp)


@cache
def gpt(tp: int) -> list[dict]:
    return run_spmd("spmd.tp_checks:gpt_checks", tp)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_single_device(tp):
    """Column, row, MLP (+SP), embedding and loss over the vocabulary: outputs, input grads,
    weight and bias grads equal nn.Linear / nn.Embedding / F.cross_entropy, on every rank."""
    for rank, diffs in enumerate(layers(tp)):
        assert len(diffs) == 26
        too_far = {name: d for name, d in diffs.items() if not d <= TOLERANCE}
        assert not too_far, f"rank {rank}: {too_far}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_matches_single_device(tp):
    """gpt-tiny: loss and every gathered gradient, under the single-device names, with and
    without SP and under activation checkpointing; then two SGD steps through `prepare`."""
    for rank, result in enumerate(gpt(tp)):
        for variant in ("tp", "tp+sp", "tp+sp+ac"):
            got = result[variant]
            assert got["names_match"] and got["tied"], (rank, variant)
            assert got["loss"] <= TOLERANCE and got["grad"] <= TOLERANCE, (rank, variant, got)
        assert result["prepare"]["names_match"]
        assert result["prepare"]["weights"] <= TOLERANCE, (rank, result["prepare"])
        assert result["prepare"]["losses"] == gpt(tp)[0]["prepare"]["losses"]  # every rank: one loss


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_are_the_papers(tp):
    """Megatron: per block, g twice in forward (after attention, after the MLP) and f twice
    in backward; plus the embedding's g, the head's f and the loss's three all-reduces (max,
    target logit, sum of exponentials). SP replaces each all-reduce of activations by a
    reduce-scatter leaving and an all-gather entering a region."""
    result = gpt(tp)[0]
    blocks = result["n_layer"]
    assert result["tp"]["forward"] == {"all_reduce": 2 * blocks + 1 + 3}
    assert result["tp"]["backward"] == {"all_reduce": 2 * blocks + 1}
    # exits: 2 per block + the embedding; entries: 2 per block + the head
    sp = {"reduce_scatter": 2 * blocks + 1, "all_gather": 2 * blocks + 1}
    assert result["tp+sp"]["forward"] == {**sp, "all_reduce": 3}
    assert result["tp+sp"]["backward"] == sp  # each one's conjugate
    # checkpointing recomputes each block's forward inside backward: both all-gathers, but
    # only the attention's reduce-scatter, as torch stops recomputing once every saved tensor
    # is back (nothing after the MLP's reduce-scatter saves anything)
    assert result["tp+sp+ac"]["forward"] == result["tp+sp"]["forward"]
    assert result["tp+sp+ac"]["backward"] == {"reduce_scatter": sp["reduce_scatter"] + blocks,
                                              "all_gather": sp["all_gather"] + 2 * blocks}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequence_parallel_needs_a_divisible_sequence():
    message = gpt(2)[0]["sp_error"]
    assert "sequence has 3 tokens" in message and "divisible by 2" in message


@pytest.mark.parametrize("tp, what", [(3, "4 attention heads of gpt-tiny"), (8, "4 attention heads of gpt-tiny")])
def test_tp_must_divide_the_heads(tp, what):
    with pytest.raises(ValueError, match=f"tp {tp} does not divide the {what}; use a tp that divides 4"):
        check_divisible(GPT_SIZES["gpt-tiny"], tp)


def test_tp_must_divide_the_vocabulary():
    from dataclasses import replace

    with pytest.raises(ValueError, match="tp 2 does not divide the 127 vocabulary entries"):
        check_divisible(replace(GPT_SIZES["gpt-tiny"], vocab_size=127), 2)
    check_divisible(GPT_SIZES["gpt2"], 1)  # tp 1 divides everything


def test_run_config_refuses_dp_and_pp():
    """tp-scratch splits layers only: nothing averages over replicas or runs stages (ddp-scratch
    --tp adds dp). The grid's rule says so before any process starts (prepare trusts it)."""
    with pytest.raises(ConfigError, match="tensor parallel only: it does not take dp=2"):
        RunConfig(strategy="tp-scratch", world_size=4, tp=2, dp=2).validate()
    with pytest.raises(ConfigError, match="does not combine with pp"):
        RunConfig(strategy="tp-scratch", world_size=4, tp=2, pp=2).validate()
