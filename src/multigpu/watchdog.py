"""No worker outlives a killed launcher.

`launch.run_torchrun` starts torchrun in a session of its own, so that stopping it reaches every
worker (one process group) and a Ctrl-C goes to the launcher first. Nothing then stops torchrun when
the launcher itself is killed outright (SIGKILL, the OOM killer): the workers would go on training
and writing checkpoints unwatched, into the folder the next run resumes from. A watchdog, a small
process in a session of its own too (so that a signal to the launcher's group spares it), polls for
the launcher's death (it is then re-parented), stops torchrun's process group as `launch._stop`
does (SIGTERM, then SIGKILL after 10 s) and removes the run's folder. The launcher kills the
watchdog when torchrun ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# run as `python -I -S -c`: the standard library only, so that it starts in milliseconds
WATCHDOG = """
import os, shutil, signal, sys, time
launcher, group, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
while os.getppid() == launcher:
    time.sleep(0.2)
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        break
    for _ in range(50):  # up to 10 s for the group to end
        time.sleep(0.2)
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
    else:
        continue
    break
if run_dir:
    shutil.rmtree(run_dir, ignore_errors=True)
"""


def start_watchdog(group: int, run_dir: Path | None) -> subprocess.Popen:
    """Watch this process: when it dies, stop process group `group` (torchrun's) and remove `run_dir`."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHDOG, str(os.getpid()), str(group),
                             str(run_dir or "")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
