"""The GPU path, proven without a GPU: the records servers with CUDA GPUs write
(tests/gpu_shaped.py: 1, 2 and 3 GPUs, a partial 3, and 8), checked against what the GPU
path writes and what the experiments size for the GPUs. The chapters read them in
tests/test_gpu_chapters.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from gpu_shaped import (
    A100,
    COMMITTED,
    H100,
    SERVERS,
    V100,
    committed_tags,
    fake_cuda,
    gpu_train_result,
    kernel_env,
    server_results,
    template,
    training_records,
)
from multigpu import experiments, records, runtime
from multigpu.config import RunConfig
from multigpu.experiments import EXPERIMENTS, Job
from multigpu.memory import CATEGORIES

TAGS = {"1xA100": "1xA100-SXM4-80GB-nccl", "2xH100": "2xH100-nccl", "3xA100": "3xA100-SXM4-80GB-nccl",
        "3xV100-partial": "3xV100-SXM2-32GB-nccl", "8xH100": "8xH100-nccl"}
TRAINING = [e for e in EXPERIMENTS if not any(isinstance(item, Job) for item in EXPERIMENTS[e]())]


@pytest.fixture(scope="session")
def gpu_results(tmp_path_factory):
    """gpu_results(server) -> (folder, GPU tag): results/ as that server (SERVERS) leaves it,
    written once per session."""
    return lambda server: server_results(server, tmp_path_factory)


# -- the stand-in for train() ------------------------------------------------------------

@pytest.fixture(scope="module")
def train_result_keys() -> set[str]:
    """The keys of what train() really returns (one step of gpt-tiny, in this process)."""
    from multigpu.train import train

    cfg = RunConfig(steps=1, global_batch_size=2, dataset="dummy").validate()
    return set(train(cfg, runtime.Runtime(0, 0, 1, torch.device("cpu"), "gloo")))


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero3", "dp", "pp-1f1b"])
def test_the_stand_in_returns_what_train_returns(strategy, train_result_keys):
    cfg = RunConfig(strategy=strategy, world_size=1 if strategy == "single" else 2, model="gpt2",
                    global_batch_size=8, seq_len=256, device="cuda")
    committed = training_records(COMMITTED)
    assert set(gpu_train_result(cfg, 0, template(cfg, None, committed))) == train_result_keys


# -- the experiment lists, by GPU count -----------------------------------------------------------

# (ddp_scaling, dp_vs_ddp, sharded_memory_comm, tp_scaling) runs, and tp_scaling's degrees, as the
# reviews counted them (F3, G5): on 1 GPU the multi-process experiments are the CPU's
LISTS = {1: ((7, 7, 25, 17), {2, 4}), 2: ((5, 4, 13, 9), {2}), 3: ((5, 7, 25, 9), {2}),
         8: ((9, 7, 25, 17), {2, 8}), 16: ((11, 7, 25, 17), {2, 8})}


@pytest.mark.parametrize("gpus", sorted(LISTS))
def test_experiment_lists_are_sized_for_the_gpus(gpus, monkeypatch):
    fake_cuda(monkeypatch, gpus)
    sizes = tuple(len(EXPERIMENTS[e]()) for e in ("ddp_scaling", "dp_vs_ddp", "sharded_memory_comm", "tp_scaling"))
    degrees = {cfg.world_size for cfg in EXPERIMENTS["tp_scaling"]() if cfg.world_size > 1}
    assert (sizes, degrees) == LISTS[gpus]
    assert experiments.ddp_device() == ("cpu" if gpus == 1 else "cuda")


@pytest.mark.parametrize("gpus", sorted(LISTS))
@pytest.mark.parametrize("experiment", TRAINING)
def test_every_run_sized_for_gpus_is_valid(experiment, gpus, monkeypatch):
    """What `launch` checks first, for every run an experiment makes on 1, 2, 3, 8 and 16
    GPUs, as multigpu.experiments sizes them: the config, and a device plan that gives each rank
    (or DataParallel replica) its own GPU."""
    fake_cuda(monkeypatch, gpus)
    for cfg in EXPERIMENTS[experiment]():
        cfg.validate()
        plan = runtime.device_plan(cfg)
        assert plan.device == (cfg.device if cfg.device != "auto" else "cuda"), (cfg, plan.why)
        if plan.device == "cuda":  # a GPU for every rank, or every DataParallel replica
            assert len(plan.gpus) == (cfg.world_size if cfg.info.one_process else cfg.processes) <= gpus


def test_the_cpu_pin_holds_on_a_gpu_machine_and_the_fake_server_lifts_it(monkeypatch):
    """conftest's MULTIGPU_DEVICE=cpu: on a machine with 8 GPUs the tests still check CPU facts;
    fake_cuda lifts it, as on a server where nothing sets it."""
    assert os.environ[runtime.DEVICE_ENV] == "cpu"
    fake_cuda(monkeypatch, 8)
    assert runtime.choose_device("auto", 2)[:2] == ("cuda", "nccl") and experiments.on_gpus(8)
    monkeypatch.setenv(runtime.DEVICE_ENV, "cpu")
    assert runtime.choose_device("auto", 2)[:2] == ("cpu", "gloo")  # the pin, on the GPU machine
    assert runtime.device_plan(RunConfig(strategy="ddp", world_size=4)).device == "cpu"
    assert runtime.choose_device("cuda", 2)[0] == "cuda"  # asked for by name, the GPUs are there
    assert not experiments.on_gpus(2) and experiments.ddp_device() == "cpu"


def test_the_fake_server_reaches_the_processes_a_test_starts(monkeypatch):
    """A kernel (here a plain interpreter) started with kernel_env answers for the server: its
    torch.cuda, machine tag, the experiments' GPUs, cores, and the line at a chapter's foot."""
    kernel_env(monkeypatch, 16, V100)
    code = ("import os, torch; from multigpu import experiments, records; "
            "print(torch.cuda.device_count(), records.machine_tag(), experiments.gpus_here(), os.cpu_count(), "
            "torch.cuda.get_device_capability(), sep='|'); print(records.executed_here())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    facts, here = out.splitlines()
    assert facts == "16|16xV100-SXM2-32GB-nccl|16|32|(7, 0)"
    assert " on 16xV100-SXM2-32GB-nccl (16 x Tesla V100-SXM2-32GB, CUDA 12.8) with torch " in here
    assert "+cu128" in here and "no GPU" not in here


def test_without_the_variable_the_fake_changes_nothing():
    from fake_cuda.sitecustomize import install

    before = (torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__, os.cpu_count())
    install({})
    assert (torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__, os.cpu_count()) == before


# -- the records ---------------------------------------------------------------------------

def _failing(server: str, experiment: str, cfg) -> bool:
    fails = SERVERS[server][2]
    return bool(fails and fails(experiment, cfg))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("server", SERVERS)
def test_gpu_records_are_shaped_like_the_gpu_path(gpu_results, server):
    folder, tag = gpu_results(server)
    gpus, name, _, stopped = SERVERS[server]
    assert tag == TAGS[server]
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, gpus, name)  # every run but those that failed, and those after a stop
        made = {e: [c for c in EXPERIMENTS[e]()[:(stopped or {}).get(e)] if not _failing(server, e, c)]
                for e in TRAINING}
    runs = 0
    for path in sorted((folder / tag).glob("*.jsonl")):
        found = records.read_records(path)
        if path.stem in made:
            assert len(found) == len(made[path.stem]), path.stem  # every run but those that failed
        for r in found:
            p = r["provenance"]
            assert p["machine_tag"] == tag and p["device_type"] == "cuda" and p["cuda"] and p["nccl"]
            assert p["device_names"] == [name] * gpus
            if r.get("kind") in ("matmul", "memory"):  # machine_limits: the GPU's own peaks
                assert r["best_flops_per_s" if r["kind"] == "matmul" else "best_bytes_per_s"] > 0
                continue
            if "cell" in r:  # the parity matrix: each cell checked on the GPUs (the fake workers' losses are
                # templates, which need not match), or not built
                assert r["cell"]["status"] in ("passed", "FAILED", "not built") and r["cell"]["processes"] <= gpus
                continue
            if "loss" not in r:  # largest_batch, cp_longest: a job's measurement, probes of runs
                assert r["probes"] and (r["per_rank_batch"] > 0 if "per_rank_batch" in r else r["predicted"] > 0)
                continue
            runs += path.stem in made  # (compositions: a job whose measurements are runs)
            cfg = RunConfig.from_dict(r["config"])
            assert p["backend"] == ("threads" if cfg.strategy == "dp" else "nccl")
            assert r["loopback_bytes_per_step"] is None  # measured over gloo only
            assert all(isinstance(b, int) and b > 0 for b in r["cuda_allocator_peak_bytes_by_rank"])
            assert len(r["peak_memory_bytes_by_rank"]) == cfg.world_size
            for peak in r["peak_memory_bytes_by_rank"]:
                assert set(peak) == {*CATEGORIES, "total"}
                if cfg.strategy == "dp":  # GPUDataParallel: each device's allocator, no categories
                    assert [peak[c] for c in CATEGORIES] == [None] * len(CATEGORIES) and peak["total"] > 0
                elif cfg.info.module == "pp":  # the library's pipelines: the tracker cannot follow them
                    assert set(peak.values()) == {None}
                else:
                    assert peak["total"] == sum(peak[c] for c in CATEGORIES)
    # every run of every training experiment sized for the GPUs is there
    assert runs == sum(len(cfgs) for e, cfgs in made.items() if (folder / tag / f"{e}.jsonl").exists()) > 0


def test_dataparallel_memory_draws_what_the_gpu_path_records(gpu_results):
    """torch.nn.DataParallel's record on GPUs (GPUDataParallel.report: each device's allocator
    peak, categories None) draws as one bar per replica, its allocator's peak, not a TypeError."""
    from multigpu import plots

    folder, tag = gpu_results("2xH100")
    dp = [r for r in records.read_records(folder / tag / "dp_vs_ddp.jsonl") if r["config"]["strategy"] == "dp"]
    assert dp and all(m["params"] is None and m["total"] > 0 for r in dp for m in r["peak_memory_bytes_by_rank"])
    fig = plots.dp_memory(dp[-1])
    (ax,) = fig.axes
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([m["total"] / 2**20 for m in dp[-1]["peak_memory_bytes_by_rank"]])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["allocator's peak (not split by category)"]


RUN_SPMD = {"collectives_bandwidth", "link_model", "tp_width", "tp_collectives", "pp_bubble", "async_staleness",
            "cp_balance", "cp_timeline", "cp_longest", "checkpoint_bytes"}  # the CPU by design (cp_balance: the
# ring's blocks replayed in one process; cp_longest: a CPU budget for gpt-long, whose positions fit any GPU;
# checkpoint_bytes: a layout's bytes, the same on any device)
ONE_DEVICE = {"one_device_memory", "one_device_techniques", "machine_peak", "t5_largest_batch", "moe_balance",
              "moe_capacity", "checkpoint_cost", "machine_limits", "step_profiles", "recomputation"}


@pytest.mark.parametrize("server", SERVERS)
def test_gpu_server_files_cpu_experiments_under_its_cpu_tag(gpu_results, server):
    """What runs on the CPU by design (run_spmd, the replay; on 1 GPU every multi-process
    experiment; the compositions and the parity matrix below 8 GPUs) is filed under the server's CPU tag, never under
    the GPU's; an experiment whose every run failed has no folder but the committed one."""
    folder, tag = gpu_results(server)
    gpus = SERVERS[server][0]
    on_cpu = {p.stem for p in (folder / "cpu-32core-gloo").glob("*.jsonl")}
    on_gpus = {p.stem for p in (folder / tag).glob("*.jsonl")}
    assert on_cpu == (set(EXPERIMENTS) - ONE_DEVICE if gpus == 1 else
                      RUN_SPMD | ({"compositions", "parity_matrix"} if gpus < 8 else set()))
    missing = {"pp_schedules", "pp_memory", "tp_scaling"} if server.endswith("partial") else set()
    missing |= {e for e, runs in (SERVERS[server][3] or {}).items() if runs == 0}  # stopped before it began
    assert on_cpu | on_gpus == set(EXPERIMENTS) - missing and not on_cpu & on_gpus
    assert all((folder / COMMITTED.name / f"{e}.jsonl").exists() for e in missing)  # what chapters fall back to
    assert sorted(p.name for p in folder.iterdir()) == sorted({*committed_tags(), "cpu-32core-gloo", tag})


# one cuBLAS workspace per handle, two handles (the forward's thread and autograd's): 32 MiB each on
# Hopper, 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB on Volta and Ampere (torch 2.13, CublasHandlePool.cpp)
WORKSPACES = {H100: 2 * 32 * 2**20, A100: 2 * (8 * 2**20 + 128 * 2**10), V100: 2 * (8 * 2**20 + 128 * 2**10)}


@pytest.mark.parametrize("server", ["8xH100", "3xV100-partial", "3xA100"])
def test_the_estimate_of_a_gpu_record_counts_its_gpus_cublas_workspaces(gpu_results, server):
    """The estimator's question for a GPU record (accuracy.setup_of, held against the allocator)
    adds the workspaces of that GPU: the 32 MiB branch on an H100, the 8.125 MiB one on an A100
    or a V100 (review F4, G10)."""
    from multigpu.estimator.accuracy import setup_of

    folder, tag = gpu_results(server)
    setups = [setup_of(r) for path in (folder / tag).glob("*.jsonl") for r in records.read_records(path)
              if "config" in r]
    setups = [s for s in setups if s is not None]
    assert len(setups) > 20
    assert {(s.on_cuda, s.cuda_workspace_bytes) for s in setups} == {(True, WORKSPACES[SERVERS[server][1]])}


@pytest.mark.parametrize("server", ["8xH100", "3xV100-partial"])
def test_the_estimators_record_readers_on_a_gpu_server(gpu_results, server, monkeypatch, capsys):
    """The key assertions of the tests that read the committed records (test_estimate,
    test_calibration, test_advise; they read the committed CPU folder only, review G4b), with
    what a GPU server's results/ should give instead:
    - against_records: rows for the GPU's tracked runs, none for DataParallel or the library's
      pipelines (no categories on GPUs); the committed CPU's rows as before;
    - the machine's calibration: the GPU's from its allocator peaks, the CPU's from CPU folders
      only; `estimate --gpu` applies the GPU's and says so;
    - the 2-process runs the step-time model is compared with come from the GPU where it has
      them, and the link it is fitted with stays a CPU's (no GPU experiment fits one)."""
    from multigpu import __main__ as cli
    from multigpu.estimator.accuracy import CALIBRATED_BY, against_records, machine_calibration
    from multigpu.estimator.step_time import recorded_machine

    folder, tag = gpu_results(server)
    monkeypatch.setattr(records, "RESULTS_DIR", folder)
    every = [r for path in sorted(folder.glob("*/*.jsonl")) for r in records.read_records(path) if "config" in r]
    rows = against_records(every)
    on_gpu = {row["strategy"] for row in against_records([r for r in every
                                                          if r["provenance"]["device_type"] == "cuda"])}
    assert on_gpu >= {"single", "ddp", "zero1", "zero2", "zero3", "fsdp"} and not on_gpu & {"dp", "pp-1f1b", "pp-gpipe"}
    assert all(math.isfinite(row["total_error"]) for row in rows)
    committed = against_records([r for r in every if r["provenance"]["machine_tag"] == COMMITTED.name])
    assert {row["strategy"] for row in committed} >= {"dp", "pp-1f1b-scratch"} and len(rows) > len(committed)

    gpu_fit, cpu_fit = machine_calibration("cuda"), machine_calibration("cpu")
    assert gpu_fit is not None and gpu_fit.source.startswith(CALIBRATED_BY) and tag in gpu_fit.source
    assert cpu_fit is not None and tag not in cpu_fit.source
    assert cli.main(["estimate", "--model", "t5-small", "--gpu", "v100-32gb", "--batch-size", "2"]) == 0
    said = capsys.readouterr().out
    assert "the machine's own peak, calibrated" in said and tag in said and "no cuda machine" not in said

    two = [r for name in ("sharded_memory_comm", "tp_scaling", "pp_schedules") for r in records.load(name)
           if "config" in r and r["config"]["world_size"] == 2]
    from_gpu = {r["config"]["strategy"] for r in two if r["provenance"]["machine_tag"] == tag}
    assert from_gpu >= {"ddp", "fsdp"} and ({"tp", "pp-1f1b", "pp-gpipe"} <= from_gpu) == (server == "8xH100")
    assert recorded_machine(2).name.startswith("cpu-")


