"""The device rule's guard (multigpu.device_guard): a tensor made on the host by default and
handed to a collective by this package fails on a CPU run as it would under NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from multigpu import device_guard
from multigpu.config import RunConfig
from multigpu.device_guard import DeviceRuleError, HostTensors, watching
from multigpu.launch import launch
from multigpu.strategies.pp_split import loss_to_all


class _Pipeline:
    """A grid of two pipeline stages whose group is this one process (a broadcast from 0)."""

    def size(self, dim):
        return 2

    def group(self, dim):
        return dist.group.WORLD


def test_a_host_tensor_in_a_pipeline_broadcast_fails(one_process_group):
    """G2 as it was: the loss made without a device and broadcast over the pipeline group."""
    with watching(), pytest.raises(DeviceRuleError, match=r"dist\.broadcast at .*pp_split\.py.*made on the host"):
        loss_to_all(1.5, _Pipeline(), device=None, src=0)
    with watching():  # as it is now: on the rank's device
        assert loss_to_all(torch.tensor(1.5, device="cpu"), _Pipeline(), torch.device("cpu"), src=0) == 1.5
        assert loss_to_all(1.5, _Pipeline(), torch.device("cpu"), src=0) == 1.5


def test_marks_follow_the_tensor():
    with HostTensors():
        host = torch.tensor([1.0, 2.0])
        placed = torch.zeros(2, device="cpu")
        assert hasattr(host, device_guard._MARK) and not hasattr(placed, device_guard._MARK)
        assert hasattr(torch.cat([host, host]), device_guard._MARK)  # from host tensors alone
        assert hasattr(host.to(torch.float64), device_guard._MARK)  # a dtype is not a device
        assert not hasattr(host * placed, device_guard._MARK)  # joined with a placed tensor
        placed.add_(host)  # in place: the placed tensor stays placed
        assert not hasattr(placed, device_guard._MARK)
        assert not hasattr(torch.zeros_like(host, device=placed.device), device_guard._MARK)  # a device named
        assert hasattr(torch.zeros_like(host), device_guard._MARK)  # like a host tensor: on the host
        moved = host.to(placed.device)
        assert not hasattr(moved, device_guard._MARK)


def test_guard_is_only_on_when_asked(monkeypatch):
    monkeypatch.setenv("MULTIGPU_DEVICE_GUARD", "0")
    assert device_guard.install_if_asked() is False
    assert not getattr(dist.broadcast, "_multigpu_guarded", False)


@pytest.mark.slow
def test_every_worker_the_tests_start_is_guarded():
    """conftest sets MULTIGPU_DEVICE_GUARD=1: the worker records that it checked the rule, so
    every parity run of the suite has run under the guard."""
    record = launch(RunConfig(strategy="pp-1f1b-scratch", world_size=2, model="gpt-mini", grad_accum_steps=2,
                              steps=1, track_memory=False), progress=False)
    assert record["device_rule_checked"] is True


def test_ring_attentions_backward_refuses_a_post_order_nccl_would_mix_up():
    """One of the guard's blind spots (NCCL pairs point-to-point messages by order, not tag) has its own check:
    ring attention's backward posts keys-and-values (0) and gradient shares (1) alternately, the last share alone,
    and any other order raises at the post instead of crossing two rings of equal-shaped tensors."""
    from multigpu.strategies.cp_attention import _PostOrder

    order = _PostOrder(cp=3)
    assert [order(t) for t in (0, 1, 0, 1, 1)] == [0, 1, 0, 1, 1]
    order = _PostOrder(cp=3)
    order(0)
    with pytest.raises(RuntimeError, match=r"posted its messages as \[0, 0\].*must be \[0, 1, 0, 1, 1\]"):
        order(0)  # a second KV before the first share: on NCCL the peer's share would land in the KV buffer
    with pytest.raises(RuntimeError, match="must be"):
        _PostOrder(cp=1)(0)  # a ring of one posts one share, home already
