"""Process groups beside a run's own, on every rank of a gloo group (tests/test_process_groups.py):
`series_groups` trains a series of configs in the same processes (multigpu.worker.run_configs, as
launch_series's workers run it) and returns how many groups the rank was in before and after, and how
many each run's end destroyed; `host_group` makes the checkpoints' gloo group as a run on NCCL checks it
at its start (runtime.check_host_group), on a given interface."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from multigpu import runtime, worker


def series_groups(configs: list[dict], out: str) -> dict:
    rank = dist.get_rank()
    rt = runtime.Runtime(rank, rank, dist.get_world_size(), torch.device("cpu"), "gloo")
    before = len(runtime.process_groups())
    Path(out).mkdir(parents=True, exist_ok=True)
    destroyed = worker.run_configs(configs, rt, Path(out))
    return {"before": before, "after": len(runtime.process_groups()), "destroyed": destroyed}


def host_group(interface: str | None) -> dict:
    """check_host_group with GLOO_SOCKET_IFNAME set to `interface` (None: unset): the error's text, if any,
    and the groups the rank is in after it."""
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        runtime.check_host_group(timeout_s=60)
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "groups": len(runtime.process_groups())}
