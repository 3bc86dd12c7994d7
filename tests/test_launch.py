"""launch(): a record, or a LaunchError that says what went wrong; never a hang, never a
leftover process. Failures are made with the `fault` hook of RunConfig (testing only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from multigpu.config import ConfigError, RunConfig
from multigpu.launch import LaunchError, launch
from multigpu.memory import CATEGORIES
from multigpu.models import parameter_count


def _failure(cfg: RunConfig, **kwargs) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(cfg, progress=False, **kwargs)
    return str(info.value), time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_exception_is_reported(run_dirs, processes_mentioning):
    """Rank 1 raises at step 1: its exception comes back, the other rank does not hang."""
    message, elapsed = _failure(RunConfig(strategy="ddp", world_size=2, steps=3, fault="raise@1:1"))
    assert "rank 1 raised RuntimeError: injected fault on rank 1 at step 1" in message
    assert "traceback tail" in message
    assert elapsed < 60
    assert processes_mentioning(str(run_dirs)) == []
    assert list(run_dirs.iterdir()) == []  # the run's folder was removed


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, processes_mentioning):
    """Rank 1 dies by SIGKILL at step 1 (as the OOM killer would do it): the LaunchError's
    message, the seconds until it came, and the run's processes still alive afterwards."""
    import tempfile

    run_dirs = tmp_path_factory.mktemp("killed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(run_dirs))
        message, elapsed = _failure(RunConfig(strategy="ddp", world_size=2, steps=3, fault="kill@1:1"))
    return message, elapsed, processes_mentioning(str(run_dirs))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_worker_fails_fast_without_leftovers(killed_run):
    message, elapsed, leftovers = killed_run
    assert message.startswith("the run failed (torchrun exit code")
    assert elapsed < 60
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_worker_is_named_with_its_signal(killed_run):
    message, _, _ = killed_run
    assert "rank 1 was killed by signal SIGKILL" in message


@pytest.mark.timeout(60)
def test_port_in_use_is_refused_before_any_worker_starts(busy_port, run_dirs):
    message, elapsed = _failure(RunConfig(strategy="ddp", world_size=2, steps=3), port=busy_port)
    assert f"port {busy_port} is already in use" in message
    assert "pass another port, or none" in message
    assert list(run_dirs.iterdir()) == []  # refused before the run's folder was made
    assert elapsed < 5  # no torchrun was started


def test_bad_config_is_refused_before_any_worker_starts(run_dirs):
    with pytest.raises(ConfigError, match="world_size must be a whole number >= 1, got 0"):
        launch(RunConfig(strategy="ddp", world_size=0), progress=False)
    assert list(run_dirs.iterdir()) == []


@pytest.mark.timeout(60)
def test_timeout_message(run_dirs):
    message, elapsed = _failure(RunConfig(strategy="ddp", world_size=2, steps=1000, dataset_size=64),
                                timeout_s=0.5)
    assert message.startswith("no result after")
    assert "every worker was stopped" in message
    assert "raise timeout_s" in message and "fewer steps (1000)" in message
    assert elapsed < 30


@pytest.mark.timeout(60)
def test_timeout_message_shows_the_limit(run_dirs):
    message, _ = _failure(RunConfig(strategy="ddp", world_size=2, steps=1000, dataset_size=64), timeout_s=0.5)
    assert "no result after 0.5 s" in message


@pytest.mark.timeout(60)
def test_timeout_leaves_no_run_folder(run_dirs):
    _failure(RunConfig(strategy="ddp", world_size=2, steps=1000, dataset_size=64), timeout_s=0.5)
    assert list(run_dirs.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_timeout_stops_running_workers(run_dirs, processes_mentioning):
    """Workers that are training when the time is up are all stopped, torchrun too."""
    seen: list[str] = []
    done = threading.Event()

    def watch():  # prove that workers were really running before the timeout hit
        while not done.is_set() and not seen:
            seen.extend(p for p in processes_mentioning(str(run_dirs)) if "-m multigpu.worker" in p
                        and "torch.distributed.run" not in p)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        message, elapsed = _failure(
            RunConfig(strategy="ddp", world_size=2, steps=10**6, dataset_size=64), timeout_s=8)
    finally:
        done.set()
        watcher.join()
    assert message.startswith("no result after 8 s")
    assert seen, "no worker started within the timeout; the test proved nothing"
    assert processes_mentioning(str(run_dirs)) == []
    assert elapsed < 40  # 8 s, plus at most the SIGTERM grace period


@pytest.fixture(scope="module")
def ddp_record():
    """One normal run, with an explicit rendezvous port (the c10d path; None is --standalone)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return launch(RunConfig(strategy="ddp", world_size=2, steps=3), port=port, progress=False)


@pytest.mark.slow
def test_record_schema(ddp_record):
    """Every field the book reads, with one entry per step or per rank."""
    record, steps, world_size = ddp_record, 3, 2
    assert RunConfig.from_dict(record["config"]) == RunConfig(strategy="ddp", world_size=2, steps=3)
    assert record["parameters"] == parameter_count("gpt-tiny")
    assert record["step_time_s"] > 0
    # tokens per second: global batch x sequence length per step time
    assert record["tokens_per_s"] == pytest.approx(8 * record["seq_len"] / record["step_time_s"])
    assert len(record["loss"]) == steps and all(isinstance(x, float) for x in record["loss"])
    assert len(record["peak_memory_bytes_by_rank"]) == world_size
    for memory in record["peak_memory_bytes_by_rank"]:
        assert set(memory) == {*CATEGORIES, "total"} == {"params", "grads", "optimizer", "activations",
                                                         "other", "total"}
        assert memory["total"] == sum(memory[c] for c in CATEGORIES)
    assert len(record["comm_bytes_per_step_by_rank"]) == world_size
    assert all(isinstance(d, dict) for d in record["comm_bytes_per_step_by_rank"])
    provenance = record["provenance"]
    for key in ("git_commit", "date", "torch", "backend", "world_size", "device_names", "threads_per_worker"):
        assert key in provenance
    assert provenance["backend"] == "gloo"
    assert provenance["world_size"] == world_size
    assert provenance["threads_per_worker"] >= 1
    assert isinstance(provenance["device_names"], list) and provenance["device_names"]


def test_top_level_api_gives_the_functions():
    """The package docstring's usage: `from multigpu import RunConfig, launch, check`."""
    import multigpu

    src = os.path.dirname(os.path.dirname(multigpu.__file__))
    code = ("from multigpu import launch, check, LaunchError\n"
            "import multigpu.launch, multigpu.check\n"
            "from multigpu import launch as again, check as check_again\n"
            "functions = (launch, check, again, check_again)\n"
            "assert all(callable(f) and not isinstance(f, type(multigpu)) for f in functions)")
    # the other order: a submodule imported first (as `multigpu.check` itself does)
    code_submodule_first = ("import multigpu.check, multigpu.launch\n"
                            "from multigpu import launch, check\n"
                            "assert all(callable(f) and not isinstance(f, type(multigpu)) for f in (launch, check))")
    for program in (code, code_submodule_first):
        out = subprocess.run([sys.executable, "-c", program], env=dict(os.environ, PYTHONPATH=src),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, world_size", [("single", 1), ("zero3", 2)])
def test_a_diverging_run_fails_and_says_why(strategy, world_size):
    """A loss that turns non-finite stops the run at that step with the likely cause, on
    every strategy (the check is in the one training loop); nothing is recorded."""
    cfg = RunConfig(strategy=strategy, world_size=world_size, lr=1e3, steps=6, track_memory=False)
    with pytest.raises(LaunchError, match=r"training diverged at step \d+: the loss is nan.*lr=1000"):
        launch(cfg, progress=False)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_learning_rate_is_bad_input(lr):
    with pytest.raises(ConfigError, match="lr must be a finite number"):
        RunConfig(lr=lr).validate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_train_like_one_device(tmp_path, run_dirs, processes_mentioning):
    """Two torchrun agents on this machine stand in for two nodes: each is started the way
    a node is (same config, its own node rank, one rendezvous endpoint), they meet over
    c10d, and the 4 processes train exactly like one process on the whole batch."""
    import torch

    # hybrid sharding, as across real nodes: each node's 2 processes shard the model (their
    # ranks are consecutive), the two nodes are replicas of each other
    cfg = RunConfig(strategy="fsdp", world_size=4, steps=3, optimizer="sgd-momentum", lr=0.05,
                    track_memory=False, extra={"replicas": 2}).validate()
    endpoint = f"127.0.0.1:{_free_port()}"
    out: dict = {}

    def node(rank: int) -> None:
        try:
            out[rank] = launch(cfg, nnodes=2, node_rank=rank, rdzv_endpoint=endpoint, progress=False,
                               params_path=tmp_path / f"node{rank}.pt", timeout_s=240)
        except BaseException as err:  # noqa: BLE001 (reported below)
            out[rank] = err

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(out[r], dict) for r in (0, 1)), out
    assert out[0]["loss"] == out[1]["loss"]  # every node gets the record
    reference = launch(cfg.replace(strategy="single", world_size=1, extra={}), progress=False,
                       params_path=tmp_path / "single.pt")
    assert max(abs(a - b) for a, b in zip(out[0]["loss"], reference["loss"])) <= 1e-5
    ours, ref = torch.load(tmp_path / "node1.pt"), torch.load(tmp_path / "single.pt")
    assert ours.keys() == ref.keys()
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5
    assert processes_mentioning(str(run_dirs)) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("node_rank", [0, 1], ids=["node0-alone", "node1-nobody-at-endpoint"])
def test_a_node_that_meets_nobody_stops_in_bounded_time(node_rank, run_dirs, processes_mentioning):
    """Node 0 waiting for a node that never comes, or node 1 pointed at an endpoint where no
    one listens: a message that says where they were to meet and what to check, within the
    timeout, and no process left behind."""
    endpoint = f"127.0.0.1:{_free_port()}"
    message, elapsed = _failure(RunConfig(strategy="ddp", world_size=4, steps=2), nnodes=2, node_rank=node_rank,
                                rdzv_endpoint=endpoint, timeout_s=8)
    assert f"the nodes did not meet at {endpoint}" in message
    assert "node 0 runs the same command with node_rank 0" in message
    assert elapsed < 45
    assert processes_mentioning(str(run_dirs)) == []


@pytest.mark.parametrize("kwargs, expected", [
    (dict(nnodes=2), "2 nodes need a rendezvous endpoint"),
    (dict(nnodes=2, node_rank=2, rdzv_endpoint="10.0.0.1:29500"), "node_rank must be a whole number from 0 to "
                                                                  "nnodes - 1 = 1, got 2"),
    (dict(nnodes=0), "nnodes must be a whole number >= 1"),
    (dict(nnodes=3, rdzv_endpoint="10.0.0.1:29500"), "world_size=4 processes do not split evenly over 3 nodes"),
    (dict(nnodes=2, rdzv_endpoint="10.0.0.1"), "rdzv_endpoint must look like HOST:PORT"),
    (dict(nnodes=2, rdzv_endpoint="10.0.0.1:70000"), "rdzv_endpoint must look like HOST:PORT"),
    (dict(nnodes=2, rdzv_endpoint="10.0.0.1:29500", port=29501), "either port (one machine) or rdzv_endpoint"),
])
def test_bad_node_arguments_are_refused_before_anything_starts(kwargs, expected, run_dirs):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        launch(RunConfig(strategy="ddp", world_size=4), progress=False, **kwargs)
    assert list(run_dirs.iterdir()) == []


def test_a_run_that_cannot_fit_is_refused_with_the_estimators_numbers(monkeypatch, run_dirs):
    """With 200 MiB free, gpt-small at a batch of 256 is refused before any worker starts,
    with what it needs, what is free and the largest batch the estimator says fits."""
    from multigpu.estimator import fits

    monkeypatch.setattr(fits, "available_bytes", lambda device, gpu=0: 200 * 2**20)
    cfg = RunConfig(strategy="ddp", world_size=2, model="gpt-small", global_batch_size=256, steps=2)
    with pytest.raises(ConfigError) as info:
        launch(cfg, progress=False)
    message = str(info.value)
    assert "this run needs about" in message and "GiB per process" in message
    assert "2 processes on this machine need" in message and "0.2 GiB is free" in message
    assert "try --global-batch-size" in message and "--no-memory-check" in message
    assert not list(run_dirs.glob("multigpu-run-*"))  # nothing started


def test_a_small_run_pays_no_estimate(monkeypatch):
    """The screen lets a run far below the free memory through without the estimator."""
    from multigpu.estimator import fits, peak

    monkeypatch.setattr(peak, "estimate", lambda *a, **k: pytest.fail("the estimator ran"))
    cfg = RunConfig(strategy="ddp", world_size=2, steps=2).validate()
    assert fits.memory_problem(cfg, "cpu", 2) is None
