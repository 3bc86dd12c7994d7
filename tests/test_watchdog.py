"""No process outlives a killed launcher (k01): SIGKILL to the process that started torchrun, and torchrun
and its workers are stopped within seconds, and the run's folder is removed (multigpu.watchdog)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GONE_WITHIN_S = 20  # the watchdog's poll (0.2 s), torchrun's and the workers' exit after SIGTERM, then SIGKILL


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def _gone(tmp_path: Path, processes_mentioning) -> bool:
    return not processes_mentioning(str(tmp_path)) and not list(tmp_path.glob("multigpu-run-*"))


def _killed_leaves_nothing(launcher: subprocess.Popen, started, tmp_path: Path, processes_mentioning):
    """Once `started()` returns (it waits for the run to start), SIGKILL to `launcher`: every process naming tmp_path
    and the run's folder are gone within GONE_WITHIN_S."""
    try:
        started()
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _wait_for(lambda: _gone(tmp_path, processes_mentioning), GONE_WITHIN_S,
                  f"every process and the run's folder gone; left: {processes_mentioning(str(tmp_path))}")
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_workers_that_print_nothing_stop_when_the_launcher_is_killed(tmp_path, processes_mentioning):
    """Workers that would run ten minutes without a word (a long step: nothing they write to the dead launcher's
    pipe stops them) are gone within seconds of the launcher's SIGKILL, with the run's folder."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    run_dir = tmp_path / "multigpu-run-test"
    run_dir.mkdir()
    code = ("from pathlib import Path\nfrom multigpu.launch import run_torchrun\n"
            f"run_torchrun([{str(script)!r}], processes=2, rendezvous=['--standalone'], threads=1, timeout_s=600, "
            f"progress=False, bar=(0, 'sleep'), run_dir=Path({str(run_dir)!r}))\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # torchrun and its two workers, each naming the script
    _killed_leaves_nothing(launcher, lambda: _wait_for(lambda: len(processes_mentioning(str(script))) >= 3, 120,
                                                       "torchrun started two workers"),
                           tmp_path, processes_mentioning)


def test_a_killed_run_command_leaves_no_process_and_no_folder(tmp_path, processes_mentioning):
    """`python -m multigpu run` killed with SIGKILL while its workers train: nothing of the run is left."""
    env = dict(os.environ, TMPDIR=str(tmp_path), MULTIGPU_PROGRESS="0")
    run = subprocess.Popen([sys.executable, "-m", "multigpu", "run", "--strategy", "ddp", "--world-size", "2",
                            "--model", "gpt-tiny", "--steps", "100000", "--dataset-size", "64",
                            "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1000"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def started():
        _wait_for(lambda: len(list(tmp_path.glob("multigpu-run-*/started-rank*"))) == 2, 180, "both workers started")
        time.sleep(1.0)  # into the training

    _killed_leaves_nothing(run, started, tmp_path, processes_mentioning)
