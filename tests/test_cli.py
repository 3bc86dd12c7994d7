"""The command line, `python -m multigpu`, run as a reader would run it: in a subprocess.

Good input: exit code 0 and exactly one JSON object on stdout with --json.
Bad input: a non-zero exit code and one `error: ...` line on stderr, never a traceback."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import multigpu
from multigpu import __main__ as cli
from multigpu.config import RunConfig

SRC = str(Path(multigpu.__file__).resolve().parents[1])  # the package under test


def run_cli(*args: str, timeout: float = 180, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
               MULTIGPU_PROGRESS="0", **env_vars)
    return subprocess.run([sys.executable, "-m", "multigpu", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def in_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m multigpu ARGS` run by its `main` in this process: what the process runs, without
    starting Python and importing torch again (the tests that start real processes show that
    the process adds nothing: one error line, the exit code, JSON on stdout)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exit:  # argparse's own refusals
            code = exit.code
    return subprocess.CompletedProcess(["python", "-m", "multigpu", *args], code, out.getvalue(), err.getvalue())


def only_json_line(stdout: str) -> dict:
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_run_json():
    out = run_cli("run", "--strategy", "ddp", "--world-size", "2", "--steps", "3", "--json")
    assert out.returncode == 0, out.stderr
    record = only_json_line(out.stdout)
    for key in ("config", "step_time_s", "tokens_per_s", "loss", "peak_memory_bytes_by_rank",
                "comm_bytes_per_step_by_rank", "provenance"):
        assert key in record
    assert RunConfig.from_dict(record["config"]) == RunConfig(strategy="ddp", world_size=2, steps=3)
    assert len(record["loss"]) == 3
    assert len(record["peak_memory_bytes_by_rank"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_run_dp_says_which_data_parallel_it_used():
    """dp is one process whatever the replica count; on CPU it says it is the from-scratch one."""
    out = run_cli("run", "--strategy", "dp", "--world-size", "2", "--steps", "3")
    assert out.returncode == 0, out.stderr
    assert "DataParallel from scratch, 2 threads on the CPU" in out.stderr
    assert "dp on 2 replica(s) in one process" in out.stdout
    assert "implementation  from scratch" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_check_json():
    out = run_cli("check", "--strategy", "ddp-scratch", "--world-size", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = only_json_line(out.stdout)
    assert {"strategy", "world_size", "steps", "max_abs_param_diff", "max_abs_loss_diff", "passed"} <= set(result)
    assert (result["strategy"], result["world_size"], result["steps"]) == ("ddp-scratch", 2, 3)
    assert result["max_abs_param_diff"] <= 1e-5 and result["max_abs_loss_diff"] <= 1e-5
    assert result["passed"] is True


BAD_INPUTS = {
    "unknown strategy": (["--strategy", "fsdp9"], "unknown strategy 'fsdp9'"),
    "world size 0": (["--strategy", "ddp", "--world-size", "0"], "world_size must be a whole number >= 1"),
    "batch not divisible": (["--strategy", "ddp", "--world-size", "3"], "does not split evenly"),
    "unknown model": (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    "unknown dtype": (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    "unknown optimizer": (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    # the rank grid: degrees that do not tile the world, or that the strategy does not take
    "degrees do not multiply": (["--strategy", "ddp", "--world-size", "6", "--dp", "4"],
                                "world size 6 != dp 4 x pp 1 x tp 1 = 4"),
    "strategy without tp": (["--strategy", "zero2", "--world-size", "4", "--tp", "2"],
                            "strategy 'zero2' does not combine with tp (tp=2)"),
    "tp does not divide the heads": (["--strategy", "tp", "--world-size", "3", "--global-batch-size", "3"],
                                     "tp 3 does not divide the 4 attention heads"),
    "sequence not divisible": (["--strategy", "tp-scratch", "--world-size", "2", "--seq-len", "33",
                                "--sequence-parallel"], "tp 2 does not divide the 33 sequence length"),
    "config file missing": (["--strategy", "tp", "--model", "no/such/config.json"], "no/such/config.json"),
    "port out of range": (["--port", "70000"], "port must be a whole number from 1 to 65535, got 70000"),
    "negative port": (["--port", "-1"], "port must be a whole number from 1 to 65535, got -1"),
    "timeout not positive": (["--timeout", "0"], "timeout must be a positive number of seconds"),
    "learning rate nan": (["--lr", "nan"], "lr must be a finite number"),
    "bucket beyond any model": (["--strategy", "ddp", "--bucket-cap-mb", "1e308"],
                                "bucket_cap_mb must be a positive number of MiB up to 1048576"),
    # many nodes: an endpoint is needed, the node rank must be one of the nodes
    "nodes without an endpoint": (["--strategy", "ddp", "--world-size", "4", "--nnodes", "2"],
                                  "2 nodes need a rendezvous endpoint"),
    "node rank out of range": (["--strategy", "ddp", "--world-size", "4", "--nnodes", "2", "--node-rank", "5",
                                "--rdzv-endpoint", "10.0.0.1:29500"],
                               "node_rank must be a whole number from 0 to nnodes - 1 = 1"),
    # compositions: the grid must tile the world
    "3D grid that does not tile": (["--strategy", "pp-1f1b", "--world-size", "8", "--tp", "2", "--dp", "3"],
                                   "world size 8 != dp 3 x pp 1 x tp 2 = 6"),
    # pipelines: more stages than blocks, too few micro-batches for the schedule
    "more stages than blocks": (["--strategy", "pp-1f1b-scratch", "--world-size", "4", "--model", "gpt-tiny"],
                                "4 stages cannot split gpt-tiny's 2 blocks"),
    "1F1B with m < stages": (["--strategy", "pp-1f1b", "--world-size", "2", "--micro-batches", "1"],
                             "needs at least as many micro-batches as stages"),
    "batch not divisible into micro-batches": (["--strategy", "pp-gpipe", "--world-size", "2", "--micro-batches",
                                                "3"], "does not split evenly"),
}


@pytest.mark.parametrize("args, expected", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_is_one_error_line(args, expected, capsys, monkeypatch):
    """In this process (`main`, what `python -m multigpu` runs: test_port_in_use_is_one_error_line
    and the runs above show the same through a real process): nothing starts, one line says why."""
    monkeypatch.setenv("MULTIGPU_PROGRESS", "0")
    try:
        code = cli.main(["run", *args, "--steps", "2"])
    except SystemExit as exit:  # argparse's own refusals (a bad choice, a missing value)
        code = exit.code
    out = capsys.readouterr()
    assert code != 0
    said = [line for line in out.err.splitlines() if not line.startswith("multigpu: ")]  # but notes
    assert len(said) == 1 and said[0].startswith("error: ") and expected in said[0], out.err
    assert out.out == ""


@pytest.mark.timeout(60)
def test_port_in_use_is_one_error_line(busy_port):
    out = run_cli("run", "--strategy", "ddp", "--steps", "2", "--port", str(busy_port), "--json", timeout=60)
    assert out.returncode != 0
    assert f"error: port {busy_port} is already in use" in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""


# -- the options reach the RunConfig (in-process: launch/check replaced by recorders) ----

OPTIONS = ["--strategy", "ddp-scratch", "--world-size", "4", "--model", "gpt-mini", "--global-batch-size", "16",
           "--grad-accum-steps", "2", "--seq-len", "32", "--dtype", "bf16-mixed", "--optimizer", "adamw",
           "--lr", "0.003", "--steps", "7", "--activation-checkpointing", "--dataset", "dummy", "--seed", "5",
           "--device", "cpu", "--bucket-cap-mb", "0.5", "--threads-per-worker", "1"]
EXPECTED = RunConfig(strategy="ddp-scratch", world_size=4, model="gpt-mini", global_batch_size=16,
                     grad_accum_steps=2, seq_len=32, dtype="bf16-mixed", optimizer="adamw", lr=0.003, steps=7,
                     activation_checkpointing=True, dataset="dummy", seed=5, device="cpu", bucket_cap_mb=0.5,
                     threads_per_worker=1)


def test_run_passes_every_option(monkeypatch, capsys):
    seen = {}

    def fake_launch(cfg, **kwargs):
        seen["cfg"], seen["kwargs"] = cfg, kwargs
        return {"config": cfg.to_dict()}

    monkeypatch.setattr(importlib.import_module("multigpu.launch"), "launch", fake_launch)
    assert cli.main(["run", *OPTIONS, "--port", "29555", "--timeout", "12", "--json"]) == 0
    assert seen["cfg"] == EXPECTED
    assert seen["kwargs"]["port"] == 29555 and seen["kwargs"]["timeout_s"] == 12
    assert json.loads(capsys.readouterr().out) == {"config": EXPECTED.to_dict()}


def test_check_passes_every_option(monkeypatch):
    seen = {}

    def fake_check(strategy, world_size, **kwargs):
        seen.update(kwargs, strategy=strategy, world_size=world_size)
        return {"strategy": strategy, "world_size": world_size, "steps": kwargs["steps"], "passed": True,
                "max_abs_param_diff": 0.0, "max_abs_loss_diff": 0.0, "tolerance": kwargs["tolerance"]}

    monkeypatch.setattr(importlib.import_module("multigpu.check"), "check", fake_check)
    assert cli.main(["check", *OPTIONS, "--json"]) == 0
    for field, value in EXPECTED.to_dict().items():
        if field in ("track_memory", "fault", "extra"):  # not command-line options
            continue
        assert seen.get(field) == value, field


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_interrupted_figures_keep_the_finished_runs(tmp_path):
    """Ctrl-C during `figures`: exit 130, a message saying where the finished runs are,
    and those runs in the results file as whole records."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
               MULTIGPU_PROGRESS="0", MULTIGPU_RESULTS=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "figures", "--experiments", "async_staleness"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    from multigpu.records import machine_tag

    results = tmp_path / machine_tag("cpu") / "async_staleness.jsonl"
    # the first run takes about a minute on 2 idle cores, and twice that or more beside another suite's processes
    deadline = time.monotonic() + 300
    while not results.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "the runs that finished are kept in" in out
    kept = [json.loads(line) for line in results.read_text().splitlines()]
    assert 1 <= len(kept) < 5 and all(r["experiment"] == "async_staleness" for r in kept)


def test_figures_refuses_a_results_folder_that_is_a_file(tmp_path):
    """MULTIGPU_RESULTS naming a file: one line before any run starts, not a traceback after."""
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    out = run_cli("figures", "--experiments", "link_model", MULTIGPU_RESULTS=str(a_file), timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: the results folder {a_file} cannot be made: {a_file} is a file; "
                                  "point MULTIGPU_RESULTS at a folder (or unset it for results/)")


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_strategy_runs_with_only_its_name_and_a_world_size(command, world_size, capsys):
    """`run`/`check --strategy S --world-size N`, as a new user types them, is a valid run for every
    strategy (a pipeline picks a model with a block per stage and enough micro-batches, and says
    so), or is refused with the one flag to add."""
    from multigpu.config import STRATEGIES, ConfigError
    from multigpu.models import GPT_SIZES
    from multigpu.strategies.pp import SCHEDULES, microbatch_problem

    parser = cli.build_parser()
    for strategy in STRATEGIES:
        if strategy == "single":
            continue
        args = parser.parse_args([command, "--strategy", strategy, "--world-size", str(world_size)])
        try:
            cfg = cli._config(args)
        except ConfigError as err:  # too few blocks in every small preset: the message names the flag
            assert "--model gpt2" in str(err), (strategy, str(err))
            continue
        assert cfg.world_size == world_size and cfg.grid.size == world_size
        if cfg.info.spans == "pp":  # a block per stage, micro-batches the schedule takes, and said so
            stages = cfg.grid.pp * (SCHEDULES[strategy].stages_per_rank if strategy in SCHEDULES else 1)
            assert GPT_SIZES[cfg.model].n_layer >= stages
            assert strategy not in SCHEDULES or microbatch_problem(strategy, cfg.grad_accum_steps, cfg.grid.pp) is None
            picked = capsys.readouterr().err
            if cfg.model != "gpt-tiny":
                assert f"{strategy} on {world_size} processes: model {cfg.model}" in picked
            if cfg.grad_accum_steps != 1:
                assert "(give --grad-accum-steps to choose)" in picked


def test_a_users_own_choice_is_kept(capsys):
    args = cli.build_parser().parse_args(["run", "--strategy", "pp-1f1b", "--world-size", "2",
                                          "--grad-accum-steps", "1"])
    with pytest.raises(multigpu.ConfigError, match="grad_accum_steps=1 < 2 stages"):
        cli._config(args)
    args = cli.build_parser().parse_args(["run", "--strategy", "pp-gpipe", "--world-size", "4", "--model", "gpt-small"])
    assert cli._config(args).model == "gpt-small" and "instead of" not in capsys.readouterr().err


def test_run_profile_prints_the_mfu_and_where_the_step_went(tmp_path, monkeypatch):
    """`run --profile`: the MFU against the machine's measured peak (here a stand-in peak, written as the
    machine_limits experiment writes it), and rank 0's profiled step by category."""
    from multigpu import records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    records.write_records(records.results_path("machine_limits"), [
        {"kind": "matmul", "dtype": "fp32", "threads": t, "n": 256, "best_flops_per_s": 1e11 * t}
        for t in range(1, 65)])
    out = in_process("run", "--strategy", "single", "--model", "gpt-tiny", "--steps", "4", "--profile")
    assert out.returncode == 0, out.stderr
    assert re.search(r"MFU +\d+\.\d% of this machine's measured peak \(HFU \d+\.\d%\)", out.stdout), out.stdout
    assert re.search(r"profile, rank 0: matmul \d+%", out.stdout), out.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_saved_at_step_3_resumes_to_step_6_with_the_defaults(tmp_path):
    """`run --steps 3 --checkpoint-dir ck`, then `run --steps 6 --resume ck`, nothing else given: the data set does
    not depend on --steps, so the resumed run trains on the unbroken run's batches, and its losses equal that run's
    bit for bit (the restored steps' from the checkpoint, the trained steps' computed again)."""
    ck = str(tmp_path / "ck")
    saved = in_process("run", "--steps", "3", "--checkpoint-dir", ck, "--json")
    assert saved.returncode == 0, saved.stderr
    resumed = in_process("run", "--steps", "6", "--resume", ck, "--json")
    assert resumed.returncode == 0, resumed.stderr
    unbroken = in_process("run", "--steps", "6", "--json")
    assert unbroken.returncode == 0, unbroken.stderr
    losses = [json.loads(out.stdout)["loss"] for out in (saved, resumed, unbroken)]
    assert losses[1] == losses[2] and losses[0] == losses[2][:3], losses
    assert json.loads(resumed.stdout)["checkpoint"]["resumed"]["steps_done"] == 3


def test_the_summary_says_what_the_run_was(monkeypatch, capsys):
    """run's summary names the ep degree, the recomputation mode, that short runs time their instruments too, the
    experts' dropped tokens, and a resumed checkpoint's grid as the grid line writes it (not a raw dict)."""
    record = {"peak_memory_bytes_by_rank": [{"params": 2**20}], "provenance": {"backend": "gloo"}, "parameters": 10,
              "loss": [5.0, 4.0], "step_time_s": 0.01, "timed_steps": 1, "step_time_includes_tracking": True,
              "tokens_per_s": 1.0, "samples_per_s": 1.0, "comm_payload_bytes_per_step_by_rank": [{}],
              "checkpoint": {"resumed": {"path": "ck/step-00000001", "steps_done": 1,
                                         "saved_by": {"strategy": "ddp", "grid": {"dp": 2, "pp": 1, "tp": 1}}}},
              "moe": {"tokens_per_expert": [[[3, 1]]], "dropped": [[1]], "top_k": 2, "capacity_factor": 0.5}}
    monkeypatch.setattr(importlib.import_module("multigpu.launch"), "launch", lambda *args, **kwargs: record)
    assert cli.main(["run", "--strategy", "fsdp", "--ep", "2", "--world-size", "2", "--model", "gpt-moe-tiny",
                     "--activation-checkpointing", "selective", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for said in ("experts cut over ep 2", "recompute   selective", "ran the memory tracker or traffic counter",
                 "median of 1 step)", "saved by ddp on dp 2 x pp 1 x tp 1", "capacity factor 0.5",
                 "25.0% of a step's routed tokens dropped"):
        assert said in out, (said, out)


def test_deepspeeds_first_build_is_announced(monkeypatch, tmp_path, capsys):
    """DeepSpeed's first run on a CPU builds its C++ extension (over a minute, silent otherwise): said once, until
    the extension is there."""
    record = {"peak_memory_bytes_by_rank": [{}], "provenance": {"backend": "gloo"}, "parameters": 10, "loss": [5.0],
              "step_time_s": None}
    monkeypatch.setattr(importlib.import_module("multigpu.launch"), "launch", lambda *args, **kwargs: record)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    argv = ["run", "--strategy", "deepspeed-moe", "--world-size", "2", "--model", "gpt-moe-tiny"]
    assert cli.main(argv) == 0
    assert "DeepSpeed builds its C++ extension on its first run" in capsys.readouterr().err
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert cli.main(argv) == 0
    assert "C++ extension" not in capsys.readouterr().err
