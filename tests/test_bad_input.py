"""Every numeric flag of every subcommand at its type's limits, found in the parser itself (a new flag is swept
without a word here): one `error: ...` line and exit code 2, before anything is traced, dry-run or started. And
the numbers the newcomer's review found unclean (advise, dryrun, estimate), each refused with what to do.
In-process and fast: parsing and validation only; what would start work raises `Started` instead."""

from __future__ import annotations

import argparse
import importlib
import time

import pytest

from cli_outcome import outcome, start
from multigpu import __main__ as cli


@pytest.fixture
def stopped(monkeypatch):
    """Every place a command starts work, stopped: torchrun, the experiments, the dry run, the estimator."""
    # imported before any stub is in place: a module that binds `from ... import estimate` on its first import
    # would otherwise keep the stub after this test (and the next module's advise would stop, not answer)
    for module in ("multigpu.estimator.advise", "multigpu.estimator.accuracy", "multigpu.estimator.cli",
                   "multigpu.estimator.predict", "multigpu.dryrun"):
        importlib.import_module(module)
    monkeypatch.setattr(importlib.import_module("multigpu.launch"), "_run", start)
    monkeypatch.setattr("multigpu.experiments.run.run_experiment", start)
    for name in ("dry_run", "dry_runs"):
        monkeypatch.setattr(f"multigpu.dryrun.{name}", start)
    for name in ("estimate", "predict_largest_batch"):
        monkeypatch.setattr(f"multigpu.estimator.peak.{name}", start)
    monkeypatch.setattr("multigpu.estimator.advise.estimate", start)
    monkeypatch.setattr("multigpu.estimator.accuracy.machine_calibration", start)
    monkeypatch.setattr("multigpu.estimator.predict._compute", start)


def numeric_flags() -> list[tuple[str, str, type]]:
    """(subcommand, flag, int or float) of every option the parser converts to a number."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [(name, action.option_strings[0], action.type) for name, command in sub.choices.items()
            for action in command._actions if action.type in (int, float) and action.option_strings]


# a base each command starts (or answers) with, so that the flag swept is what is refused
BASE = {"run": ["--strategy", "ddp", "--world-size", "2"], "check": ["--strategy", "ddp", "--world-size", "2"],
        "dryrun": ["--strategy", "fsdp", "--world-size", "2"],
        "estimate": ["--model", "gpt-tiny", "--world-size", "2", "--seq-len", "32"],
        "advise": ["--model", "gpt-tiny", "--seq-len", "32", "--gpus", "2", "--gpu-memory", "16GiB",
                   "--global-batch", "8"],
        "predict": ["--model", "gpt-tiny", "--machine", "dgx-h100"]}
# flags that only count with another strategy or model: swept where they do
CONTEXT = {"--top-k": ["--strategy", "ep-scratch", "--model", "gpt-moe-tiny"],
           "--capacity-factor": ["--strategy", "ep-scratch", "--model", "gpt-moe-tiny"],
           "--aux-loss-coef": ["--strategy", "ep-scratch", "--model", "gpt-moe-tiny"],
           "--ep": ["--strategy", "ep-scratch", "--model", "gpt-moe-tiny"],
           "--hsdp-replicas": ["--strategy", "fsdp"], "--tp": ["--strategy", "fsdp"], "--cp": ["--strategy", "fsdp"]}
# flags of a command that only count beside others: swept with their own base
OWN_BASE = {("predict", "--inter"): ["--model", "gpt-tiny", "--gpu", "h100-80gb", "--gpus-per-node", "8", "--nodes",
                                     "2", "--dp", "16"]}
LIMITS = ["1e308", "-1e308", "inf", "nan", str(10**30), "-1"]
FLAGS = numeric_flags()


def test_the_sweep_finds_the_flags():
    found = {(c, f) for c, f, _ in FLAGS}
    assert {("run", "--lr"), ("run", "--timeout"), ("check", "--tolerance"), ("dryrun", "--world-size"),
            ("dryrun", "--rank"), ("estimate", "--batch-size"), ("advise", "--global-batch"),
            ("advise", "--gpus")} <= found
    assert set(BASE) >= {c for c, _, _ in FLAGS}, "a subcommand with numeric flags needs a base here"


def _base(command: str, flag: str) -> list[str]:
    if (command, flag) in OWN_BASE:
        return [command, *OWN_BASE[command, flag]]
    context = CONTEXT.get(flag, []) if command in ("run", "check", "dryrun") else []
    if command == "dryrun" and "ep-scratch" in context:  # ep-scratch cannot dry-run: the same model under fsdp
        context = ["--strategy", "fsdp", "--model", "gpt-moe-tiny"]
    return [command, *BASE[command], *context]


def _argv(command: str, flag: str, value: str) -> list[str]:
    return [*_base(command, flag), flag, value]


@pytest.mark.usefixtures("stopped")
@pytest.mark.parametrize("command,flag,kind", FLAGS, ids=[f"{c} {f}" for c, f, _ in FLAGS])
def test_every_numeric_flag_at_its_limits_is_one_error_line(command, flag, kind):
    assert outcome(_base(command, flag))[0] == "started"  # the base itself passes
    for value in LIMITS:
        start = time.perf_counter()
        result, stderr = outcome(_argv(command, flag, value))
        lines = stderr.strip().split("\n")
        assert result == "exit 2", (command, flag, value, result, stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, (flag, value, stderr)
        assert time.perf_counter() - start < 10, (flag, value, "refused, but late")
    result, stderr = outcome(_argv(command, flag, "0"))  # zero: a valid value, or refused as the others
    assert result in ("started", "exit 2") and "Traceback" not in stderr, (flag, result, stderr)
    if result == "exit 2":
        assert len(stderr.strip().split("\n")) == 1, stderr


@pytest.mark.usefixtures("stopped")
@pytest.mark.parametrize("argv, message", [
    (["run", "--strategy", "zero2", "--lr", "1e308"], "lr must be at most"),
    (["run", "--grad-accum-steps", "0"], "grad_accum_steps must be a whole number >= 1, got 0"),
    (["run", "--global-batch-size", "0"], "global_batch_size must be a whole number >= 1, got 0"),
    (["run", "--dataset-size", "0"], "dataset_size must be a whole number >= 1, got 0"),
    (["run", "--timeout", "1e308"], "--timeout must be a positive number of seconds up to"),
    (["check", "--tolerance", "inf"], "--tolerance must be a number from 0"),
    (["run", "--checkpoint-dir", "ck", "--checkpoint-every", "0"], "(--checkpoint-every N, or leave it out)"),
])
def test_a_number_given_is_checked_as_given(argv, message):
    result, stderr = outcome(argv)
    assert result == "exit 2" and message in stderr and "None" not in stderr, stderr


# -- advise ---------------------------------------------------------------------------------------------------------

ADVISE = ["advise", "--model", "gpt2", "--gpu", "a100-80gb", "--gpus", "4"]


@pytest.mark.usefixtures("stopped")
@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "0"], "sequence lengths must be at least 1"),  # was a ZeroDivisionError
    (["--seq-len", "-1"], "sequence lengths must be at least 1"),  # was a global batch the reader never gave
    (["--global-batch", "0"], "--global-batch must be a whole number of samples from 1"),  # was replaced by 2048
    (["--global-batch", str(10**12)], "--global-batch must be a whole number of samples from 1"),  # was a hang
    (["--gpus", str(10**9)], "--gpus must be at most"),  # was 76 s and "10**9 GPUs in 1 node"
])
def test_advise_refuses_bad_numbers_at_once(extra, message):
    start = time.perf_counter()
    result, stderr = outcome([*ADVISE, *extra])
    assert result == "exit 2" and message in stderr and len(stderr.strip().split("\n")) == 1, stderr
    assert time.perf_counter() - start < 10


def test_divisors_by_trial_division_up_to_the_square_root():
    from multigpu.estimator.advise import MAX_GLOBAL_BATCH, _divisors

    for n in range(1, 500):
        assert _divisors(n) == [k for k in range(1, n + 1) if n % k == 0], n
    start = time.perf_counter()
    assert _divisors(MAX_GLOBAL_BATCH) == [2**k for k in range(31)]
    assert time.perf_counter() - start < 1


# -- dryrun and estimate --------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("stopped")
@pytest.mark.parametrize("argv, message", [
    (["--strategy", "fsdp", "--world-size", str(10**9)], "a dry run plans at most 16,384 ranks"),  # was OOM-killed
    (["--strategy", "fsdp", "--world-size", str(10**6)], "a dry run plans at most 16,384 ranks"),  # was a hang
    (["--strategy", "fsdp", "--ep", "2", "--model", "gpt-moe-tiny", "--world-size", "4"],
     "fsdp --ep 2 cannot be dry-run"),  # was an AttributeError
    (["--strategy", "fsdp", "--world-size", "2", "--grad-accum-steps", "1000"], "give at most 64"),
    (["--strategy", "fsdp", "--world-size", "2", "--global-batch-size", str(10**9)], "tokens per rank"),
    (["--strategy", "fsdp", "--world-size", "2", "--rank", "2"], "--rank 2 is not in a world of 2"),
])
def test_dryrun_refuses_what_it_cannot_run_at_once(argv, message):
    start = time.perf_counter()
    result, stderr = outcome(["dryrun", *argv])
    assert result == "exit 2" and message in stderr and len(stderr.strip().split("\n")) == 1, stderr
    assert time.perf_counter() - start < 10


def test_estimate_checks_its_question_before_tracing_the_model(monkeypatch):
    """--seq-len 0, a batch that does not split over the ranks, --world-size 0: refused before the model is traced
    (each was refused after 14 to 24 s of tracing)."""
    monkeypatch.setattr("multigpu.estimator.accuracy.machine_calibration", start)
    monkeypatch.setattr("multigpu.estimator.model_trace._activation_costs", start)
    base = ["estimate", "--model", "gpt2", "--strategy", "fsdp", "--world-size", "4", "--gpu", "a100-80gb"]
    for extra, message in ((["--seq-len", "0"], "sequence lengths must be at least 1"),
                           (["--batch-size", "3"], "must be a positive multiple of world size"),
                           (["--world-size", "0"], "--world-size must be a whole number from 1")):
        result, stderr = outcome([*base, *extra])
        assert result == "exit 2" and message in stderr, (extra, stderr)


def test_tp_advice_lists_the_degrees_that_satisfy_every_cut():
    """Each cut a tp does not divide is named, and then the degrees that divide them all (each cut's own
    suggestion alone may satisfy no other)."""
    import math

    from multigpu.config import ConfigError, RunConfig
    from multigpu.models import _config_sizes

    sizes = _config_sizes("gpt-tiny")
    common = math.gcd(sizes["heads"], sizes["kv_heads"], sizes["d_ff"], sizes["vocab"])
    with pytest.raises(ConfigError) as refused:
        RunConfig(strategy="tp", world_size=3, tp=3).validate()
    wanted = ", ".join(str(d) for d in range(1, 65) if common % d == 0)
    assert f"the tp values that divide all of these: {wanted}" in str(refused.value), str(refused.value)


def test_a_negative_fixed_part_reads_as_a_subtraction():
    """The calibration's fixed part below zero was written "+ -132 MiB"."""
    from multigpu.estimator.accuracy import Calibration

    fit = Calibration("cuda", "t5", 0.5, -132 * 2**20, 3, "the records", 0.01)
    assert "activations - 132 MiB" in fit.describe() and "+ -" not in fit.describe(), fit.describe()
