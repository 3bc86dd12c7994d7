"""Every flag of every subcommand, given generated values (zero, negative, huge, nan, inf,
empty, garbage, very long strings): either a configuration good enough to start (the test
stops it just before any worker would), or exit code 2 with a short message. Never a
traceback. In-process and fast: parsing and validation only, no worker is started.
Derandomized, so that CI sees the same examples every time; to explore new ones, run with
`--hypothesis-seed N` after removing `derandomize=True` (seed 6 once found a newline echoed
into a message)."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_outcome import outcome as cli_outcome
from cli_outcome import start

launch_module = importlib.import_module("multigpu.launch")  # the module (the package exports its function)


ODD = ["0", "-1", "-0", "1", "2", "3", "8", "1e308", "-1e308", "1e-308", "nan", "inf", "-inf", "", " ", "garbage",
       "x" * 5000, "0x10", "1.5", "2**40", "99999999999999999999", "127.0.0.1:0", "host:99999", ":29500",
       "gpt-tiny", "t5-tiny", "no/such/config.json", "fsdp", "pp-1f1b", "bf16-mixed", "cuda", "cpu", "\x00", "ä"]
VALUES = st.one_of(st.sampled_from(ODD), st.integers(-(10**30), 10**30).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=40))

RUN_FLAGS = ["--strategy", "--world-size", "--tp", "--pp", "--dp", "--hsdp-replicas", "--model", "--global-batch-size",
             "--per-rank-batch-size", "--grad-accum-steps", "--seq-len", "--dtype", "--optimizer", "--lr", "--steps",
             "--dataset", "--seed", "--device", "--bucket-cap-mb", "--threads-per-worker"]
SUBCOMMAND_FLAGS = {
    "run": RUN_FLAGS + ["--port", "--timeout", "--nnodes", "--node-rank", "--rdzv-endpoint"],
    "check": RUN_FLAGS + ["--tolerance"],
    "figures": ["--experiments"],
}
# a base that is valid on its own, so that the generated flag is what is tested
BASE = {"run": ["--strategy", "ddp", "--world-size", "2"], "check": ["--strategy", "ddp", "--world-size", "2"],
        "figures": []}


def outcome(argv: list[str], monkeypatch) -> tuple[str, str]:
    """('started' | 'exit N', stderr) of `python -m multigpu <argv>`, stopped before workers."""
    monkeypatch.setattr(launch_module, "_run", start)
    monkeypatch.setattr("multigpu.experiments.run.run_experiment", start)  # what run_experiments calls
    return cli_outcome(argv)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(SUBCOMMAND_FLAGS)), data=st.data())
def test_any_flag_value_starts_or_is_one_clear_error(command, data, monkeypatch):
    pairs = data.draw(st.lists(st.tuples(st.sampled_from(SUBCOMMAND_FLAGS[command]), VALUES), min_size=1,
                               max_size=3), label="flags")
    argv = [command, *BASE[command], *(x for pair in pairs for x in pair)]
    value = "".join(v for _, v in pairs)
    result, stderr = outcome(argv, monkeypatch)
    assert "Traceback" not in stderr, (argv, stderr)
    assert result in ("started", "exit 2"), (argv, result, stderr)
    if result == "exit 2":
        lines = stderr.strip().split("\n")  # (splitlines would also split at control characters)
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, stderr)
        assert len(stderr) < 500 + len(value), (argv, stderr)


# estimate and advise answer in-process (fake tensors, formulas): a run is an answer, exit 0
ANSWER_FLAGS = {
    "estimate": ["--model", "--strategy", "--world-size", "--tp", "--pp", "--dtype", "--optimizer", "--seq-len",
                 "--target-len", "--gpu-memory", "--gpu", "--cuda-context", "--batch-size", "--grad-accum-steps",
                 "--reshard-after-forward"],
    "advise": ["--model", "--gpus", "--gpu-memory", "--gpu", "--cuda-context", "--nodes", "--interconnect", "--dtype",
               "--optimizer", "--seq-len", "--machine", "--global-batch"],
}
ANSWER_BASE = {"estimate": ["--model", "gpt-tiny", "--world-size", "2", "--seq-len", "32"],
               "advise": ["--model", "gpt-tiny", "--seq-len", "32", "--gpus", "2", "--gpu-memory", "16GiB",
                          "--global-batch", "8"]}


@pytest.mark.timeout(300)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(ANSWER_FLAGS)), data=st.data())
def test_estimate_and_advise_answer_or_give_one_clear_error(command, data, monkeypatch):
    flag = data.draw(st.sampled_from(ANSWER_FLAGS[command]), label="flag")
    value = data.draw(VALUES, label="value")
    argv = [command, *ANSWER_BASE[command], flag, value]
    assert outcome([command, *ANSWER_BASE[command]], monkeypatch)[0] == "exit 0"  # the base itself answers
    result, stderr = outcome(argv, monkeypatch)
    assert "Traceback" not in stderr, (argv, stderr)
    assert result in ("exit 0", "exit 2"), (argv, result, stderr)
    if result == "exit 2":
        lines = stderr.strip().split("\n")
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, stderr)
