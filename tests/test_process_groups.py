"""Process groups beside a run's own (gpu-path-3 G16, G18).

A series (launch.launch_series: many runs in the same worker processes) frees the process groups each run
made: on GPUs every NCCL communicator a run used keeps its buffers in GPU memory until it is destroyed, so a long
parity series would otherwise lose memory run by run. And checkpoints' gloo group beside NCCL, which on several
nodes needs a routable interface: its name derived from NCCL's, and a wrong one refused at a run's start."""

from __future__ import annotations

import json

import pytest

from multigpu.config import RunConfig
from multigpu.runtime import gloo_interface
from multigpu.spmd import run_spmd

TINY = dict(world_size=2, model="gpt-tiny", steps=2, global_batch_size=4, seq_len=16, threads_per_worker=1)


@pytest.mark.slow
def test_each_run_of_a_series_destroys_the_groups_it_made(tmp_path):
    configs = [RunConfig(strategy="cp-scratch", cp=2, **TINY),  # the context lines
               RunConfig(strategy="tp", checkpoint_dir=str(tmp_path / "ckpt"), **TINY),  # the checkpoint's gloo
               RunConfig(strategy="ddp", **TINY)]  # at 2 ranks every group it uses is WORLD: nothing to destroy
    found = run_spmd("spmd.group_checks:series_groups", 2, configs=[c.to_dict() for c in configs],
                     out=str(tmp_path / "runs"))
    for rank in found:
        assert rank["after"] == rank["before"] == 1, rank  # WORLD alone, after as before
        made, saved, plain = rank["destroyed"]
        assert made > 0 and saved > 0 and plain == 0, rank
    for i in range(3):  # and every run still wrote its record
        assert json.loads((tmp_path / "runs" / f"run{i}" / "record.json").read_text())["loss"]


def test_gloos_interface_is_nccls_first_match_unless_named():
    names = ["lo", "docker0", "eth0", "eth1", "ib0"]
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "eth"}, names) == "eth0"  # NCCL's entries are prefixes
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "=eth1"}, names) == "eth1"  # "=": exact names
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "=eth"}, names) is None
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "mlx,ib"}, names) == "ib0"  # the first entry that matches
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "^docker,lo"}, names) is None  # an exclusion names none
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "ib0"}, names) is None  # given
    assert gloo_interface({}, names) is None


@pytest.mark.slow
def test_a_gloo_group_that_cannot_be_made_is_refused_with_what_to_set():
    """On an interface that does not exist here gloo cannot bind: check_host_group says so, and what to set,
    instead of the first save failing (or hanging on another node's unroutable address) mid-run."""
    ok = run_spmd("spmd.group_checks:host_group", 2, interface=None)
    assert all(r == {"error": None, "groups": 1} for r in ok), ok  # made, barriered and dropped again
    bad = run_spmd("spmd.group_checks:host_group", 1, interface="nosuchif0")[0]["error"]
    assert "gloo could not make one" in bad and "nosuchif0" in bad and "set GLOO_SOCKET_IFNAME" in bad, bad
