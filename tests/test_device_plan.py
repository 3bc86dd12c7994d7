"""The one device plan (runtime.plan_devices): which device and backend every rank of a launch
gets, for every strategy, on machines of 0 to 16 GPUs, on one node or two (real ones, or
stand-ins sharing this machine). NCCL refuses two ranks of one communicator on one GPU and
DataParallel needs a GPU per replica, so a plan either gives every rank its own GPU or runs on
the CPU, and a run that asks for CUDA by name without enough GPUs is refused before it starts."""

from __future__ import annotations

import importlib
import itertools

import pytest

from multigpu import runtime
from multigpu.config import STRATEGY_TABLE, ConfigError, RunConfig
from multigpu.runtime import device_plan, plan_devices

launch_module = importlib.import_module("multigpu.launch")  # the module (the package exports its function)
GPU_COUNTS = (0, 1, 2, 3, 4, 6, 8, 16)


def _configs():
    """A valid RunConfig of every strategy at every world size it takes up to 8 processes."""
    for strategy in STRATEGY_TABLE:
        for world in (1,) if strategy == "single" else (2, 4, 8):
            extra = {"replicas": 2} if strategy == "fsdp" and world == 4 else {}
            model = "gpt-moe-tiny" if STRATEGY_TABLE[strategy].spans_experts else "gpt-mini"  # experts to cut
            cfg = RunConfig(strategy=strategy, world_size=world, model=model, global_batch_size=8,
                            grad_accum_steps=4 if strategy.startswith("pp-") else 1, extra=extra)
            try:
                yield cfg.validate()
            except ConfigError:  # e.g. 8 pipeline stages of gpt-mini's 4 blocks
                continue


CONFIGS = list(_configs())


@pytest.fixture(autouse=True)
def machine_decides(monkeypatch):
    """These tests give the machine's GPU count themselves: no pin of `auto` to the CPU."""
    monkeypatch.delenv("MULTIGPU_DEVICE", raising=False)


def test_every_strategy_has_a_config_here():
    assert {c.strategy for c in CONFIGS} == set(STRATEGY_TABLE)


@pytest.mark.parametrize("gpus", GPU_COUNTS)
@pytest.mark.parametrize("nnodes, loopback", [(1, False), (2, False), (2, True)],
                         ids=["one node", "two nodes", "two stand-in nodes"])
def test_every_rank_gets_its_own_gpu_or_the_cpu(gpus, nnodes, loopback):
    for cfg in CONFIGS:
        if cfg.processes % nnodes:
            continue
        per_node = cfg.processes // nnodes
        devices = cfg.world_size if cfg.strategy == "dp" else per_node  # dp: a GPU per replica
        nodes_here = nnodes if loopback else 1
        for requested in ("auto", "cpu", "cuda"):
            where = f"{cfg.strategy} x{cfg.world_size}, {gpus} GPUs, {nnodes} node(s), {requested}"
            plans = []
            for node in range(nnodes):
                try:
                    plans.append(device_plan(cfg.replace(device=requested), nnodes=nnodes, node_rank=node,
                                             nodes_here=nodes_here, gpus=gpus))
                except ValueError as err:  # refused: a named cuda without a GPU per rank, or a CUDA-only
                    # strategy (PyTorch's context parallelism) asked for the CPU or short of GPUs
                    assert requested == "cuda" or cfg.info.cuda_only, where
                    assert gpus < devices * nodes_here or requested == "cpu", where
                    assert f"this machine has {gpus}" in str(err), where
                    assert "device='cpu'" in str(err) or cfg.info.cuda_only in str(err), where
                    break
            else:
                if requested == "cuda":
                    assert gpus >= devices * nodes_here, where
                for plan in plans:
                    if plan.device == "cuda":
                        assert plan.backend == "nccl" and len(plan.gpus) == devices, where
                        assert all(0 <= g < gpus for g in plan.gpus), where
                    else:
                        assert plan.backend == "gloo" and plan.gpus == (), where
                        assert requested == "cpu" or gpus < devices * nodes_here, where  # auto: only if short
                # nodes sharing this machine never share a GPU
                if loopback and plans[0].device == "cuda":
                    used = [g for plan in plans for g in plan.gpus]
                    assert len(used) == len(set(used)), where


def test_dp_counts_replicas_not_processes():
    """G1: dp is one process whose replicas are threads; on one GPU two replicas need the CPU."""
    dp = RunConfig(strategy="dp", world_size=2).validate()
    assert dp.processes == 1
    assert device_plan(dp, gpus=1).device == "cpu"
    assert device_plan(dp, gpus=2).gpus == (0, 1)
    with pytest.raises(ValueError, match="each of 2 replicas"):
        device_plan(dp.replace(device="cuda"), gpus=1)


def test_stand_in_nodes_take_disjoint_gpus():
    """G3: together.md's two nodes on one machine, 2 processes each: 4 GPUs are needed, and node
    1 takes GPUs 2-3; with 2 GPUs the stand-ins run on the CPU instead of sharing a GPU."""
    cfg = RunConfig(strategy="fsdp", world_size=4, extra={"replicas": 2}).validate()
    nodes = [device_plan(cfg, nnodes=2, node_rank=n, nodes_here=2, gpus=4) for n in (0, 1)]
    assert [p.gpus for p in nodes] == [(0, 1), (2, 3)]
    assert device_plan(cfg, nnodes=2, node_rank=1, nodes_here=2, gpus=2).device == "cpu"
    # real nodes each have their own GPUs 0-1
    assert device_plan(cfg, nnodes=2, node_rank=1, nodes_here=1, gpus=2).gpus == (0, 1)


def test_multigpu_device_decides_auto_and_only_auto(monkeypatch):
    """The test suite's pin (MULTIGPU_DEVICE=cpu) reaches every process through the environment;
    a run that names its device keeps it."""
    monkeypatch.setattr(runtime, "machine_gpus", lambda: 8)
    monkeypatch.setenv("MULTIGPU_DEVICE", "cpu")
    assert device_plan(RunConfig(strategy="ddp", world_size=2)).device == "cpu"
    assert device_plan(RunConfig(strategy="ddp", world_size=2, device="cuda")).device == "cuda"
    monkeypatch.delenv("MULTIGPU_DEVICE")
    assert device_plan(RunConfig(strategy="ddp", world_size=2)).device == "cuda"
    monkeypatch.setenv("MULTIGPU_DEVICE", "gpu")
    with pytest.raises(ValueError, match="MULTIGPU_DEVICE='gpu' must be auto, cpu or cuda"):
        device_plan(RunConfig(strategy="ddp", world_size=2))


def test_bad_plans_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="device must be"):
        plan_devices("gpu", processes=2, gpus=2)
    with pytest.raises(ValueError, match="processes must be"):
        plan_devices("auto", processes=0, gpus=2)
    with pytest.raises(ValueError, match="gpus must be"):
        plan_devices("auto", processes=2, gpus=-1)


def _launched(monkeypatch, cfg, visible=None, **kwargs) -> list:
    """The device and CUDA_VISIBLE_DEVICES that `launch` would start the workers with on a
    machine with 4 GPUs (and `visible`, a CUDA_VISIBLE_DEVICES already set)."""
    seen = []

    def fake_run(cfg, device, rendezvous, out_dir, **kw):
        seen.extend([device, kw["visible_gpus"]])
        return {}

    monkeypatch.setattr(runtime, "machine_gpus", lambda: 4)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(launch_module, "_run", fake_run)
    launch_module.launch(cfg, check_memory=False, progress=False, **kwargs)
    return seen


def test_launch_follows_the_plan(monkeypatch):
    """launch starts the workers on the plan's device; a stand-in node beyond the first (a
    loopback rendezvous) sees only its own GPUs, so that local rank r is its r-th GPU for torch
    and for libraries that go by LOCAL_RANK alone (DeepSpeed); a node of a real cluster sees its
    machine's GPUs as they are."""
    cfg = RunConfig(strategy="fsdp", world_size=4, extra={"replicas": 2})
    assert _launched(monkeypatch, cfg) == ["cuda", None]
    stand_in = dict(nnodes=2, rdzv_endpoint="127.0.0.1:29500")
    assert _launched(monkeypatch, cfg, node_rank=0, **stand_in) == ["cuda", None]
    assert _launched(monkeypatch, cfg, node_rank=1, **stand_in) == ["cuda", "2,3"]
    # the GPUs as CUDA_VISIBLE_DEVICES already numbers them
    assert _launched(monkeypatch, cfg, "7,6,5,4", node_rank=1, **stand_in) == ["cuda", "5,4"]
    assert _launched(monkeypatch, cfg, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500") == ["cuda", None]
    with pytest.raises(ConfigError, match="needs a CUDA GPU for each of 8 process"):
        _launched(monkeypatch, cfg.replace(world_size=8, device="cuda"))


def plan_table(gpu_counts=GPU_COUNTS) -> list[tuple[str, ...]]:
    """GPU count x (strategy, processes) -> the plan with device auto, one node: the closing
    note's table."""
    rows = []
    for cfg, gpus in itertools.product(CONFIGS, gpu_counts):
        plan = device_plan(cfg, gpus=gpus)
        rows.append((cfg.strategy, str(cfg.world_size), str(gpus), plan.device, plan.backend,
                     ",".join(map(str, plan.gpus)) or "-"))
    return rows


if __name__ == "__main__":  # python tests/test_device_plan.py: the table, as markdown
    print("| strategy | world | GPUs | device | backend | GPUs used |\n|---|---|---|---|---|---|")
    for row in plan_table():
        print("| " + " | ".join(row) + " |")
