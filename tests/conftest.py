"""Shared helpers for the test suite.

Everything runs on CPU with the gloo backend, also on a machine with GPUs: the tests check
CPU facts (4 bytes per fp32 parameter, gloo's bytes on the loopback, record counts sized
for a CPU), so `device="auto"` means the CPU here (`cpu_unless_asked`). Tests of the GPU
path ask for `device="cuda"` and are skipped without GPUs. A `launch` of workers takes a
few seconds, so tests that need a run share it through small caches in their own modules.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest


@pytest.fixture
def busy_port():
    """A port on 127.0.0.1 held open (bound and listening) for the whole test."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes (not zombies) whose command line contains `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone while we looked
            continue
        if text in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.fixture
def run_dirs(tmp_path, monkeypatch) -> Path:
    """Make `launch` create its per-run folder (config, record, worker tracebacks) under
    tmp_path, so a test can see what a run left behind and find its processes: every
    torchrun and worker command line names that folder."""
    import tempfile

    import torch._dynamo  # noqa: F401 - its first import makes a cache folder in the temp dir: not here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.fixture
def one_process_group(tmp_path):
    """A default process group of one rank (gloo, a file store under tmp_path), for the tests of what calls
    collectives in this process (the device guard, the comm counter, the checkpoint's writer)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def processes_mentioning():
    """processes_mentioning(text) -> command lines of live processes that contain text."""
    return _processes_mentioning


@pytest.fixture(scope="session", autouse=True)
def spmd_bodies_importable():
    """The parity tests' SPMD bodies live in tests/spmd/ (run_spmd("spmd.tp_checks:...", n)):
    tests/ goes on the PYTHONPATH of every process a test starts, so the workers import them
    as this process does (pytest puts tests/ on its sys.path)."""
    tests = str(Path(__file__).resolve().parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])]))
        yield


@pytest.fixture(scope="session", autouse=True)
def traces_kept_for_the_session(tmp_path_factory):
    """The estimator's fake-tensor traces (estimator.model_trace) on disk for this session: a
    chapter executed once per fake GPU server, each time in a new kernel, traces each model
    once, not once per kernel. Where `make book` ran first (as CI runs it), its folder
    (_build/traces) serves: a trace's file is named by the hash of everything that makes it (the
    arguments, torch's and transformers' versions, the source that builds and traces the model),
    so a file found there is what tracing again would give. Else a new folder for the session."""
    from multigpu.records import CHECKOUT

    built = CHECKOUT / "_build" / "traces" if CHECKOUT else None
    folder = built if built is not None and built.is_dir() else tmp_path_factory.mktemp("traces")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MULTIGPU_TRACE_CACHE", str(folder))
        yield


@pytest.fixture(autouse=True)
def cpu_unless_asked(monkeypatch):
    """device="auto" picks the CPU in every test, and in every process a test starts (workers,
    `python -m multigpu ...` subprocesses, notebook kernels): MULTIGPU_DEVICE=cpu is read by the
    one device plan (runtime.resolve_requested), and the experiments size themselves for this
    machine's CPU. device="cuda" still gets the GPUs."""
    monkeypatch.setenv("MULTIGPU_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def device_rule_guarded(monkeypatch):
    """Every worker a test starts checks the device rule (multigpu.device_guard): a tensor made
    on the host by default and handed to a collective fails the run here, as NCCL would on GPUs."""
    monkeypatch.setenv("MULTIGPU_DEVICE_GUARD", "1")


@pytest.fixture
def committed_records(monkeypatch, tmp_path_factory):
    """Hold a test to the committed records (results/ as the checkout commits it), in this process
    and in the ones it starts: a results/<gpu-tag>/ that `make figures` wrote on a GPU machine is
    not what the record-reading tests expect (review G4b); tests/test_gpu_shaped.py holds the same
    code to GPU-shaped records."""
    from gpu_shaped import only_committed_records

    only_committed_records(monkeypatch, tmp_path_factory)


def _cores() -> int:
    return os.cpu_count() or 1  # as the package counts them (launch's threads per process)


def pytest_xdist_auto_num_workers(config) -> int:
    """`make test`'s worker count (pytest -n auto): one per two cores, and at least two. A parity test
    starts 2 to 8 training processes (and torchrun), which spend much of their time waiting on each other
    and on starting Python; two workers keep a 2-core machine busy while one waits, and one per two cores
    leaves a 16-core machine's cores to the processes the tests start."""
    return max(2, _cores() // 2)


@pytest.fixture(scope="session", autouse=True)
def threads_shared_among_workers():
    """Under pytest-xdist, the tests that compute in this process (traces, dry runs, the estimator) share the
    cores with the other workers: torch's threads are this worker's share of them, not every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, _cores() // workers))
    yield


# The modules that take longest (minutes on 2 cores, measured with pytest --durations), first: pytest-xdist
# hands whole modules to its workers in the order collected, and one started last would run alone at the end.
LONGEST_FIRST = ("test_parity", "test_gpu_chapters", "test_checkpoint", "test_estimate", "test_site", "test_gpu_shaped",
                 "test_install", "test_cli", "test_predict", "test_answers", "test_calibration", "test_launch")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module's own order kept
