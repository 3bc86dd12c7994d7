"""GPU-shaped records, written without a GPU: what `make figures` leaves in results/ on a
server with CUDA GPUs (any count; an H100, A100 or V100 name), made by the code that writes
them there.

    tag = write_gpu_results(folder, gpus=8)   # -> "8xH100-nccl"
    tag = write_gpu_results(folder, gpus=3, name=A100, fails=pipelines_fail)   # -> "3xA100-SXM4-80GB-nccl"

`folder` then holds, as a server's results/ would after `make figures`:

- cpu-2core-gloo/ and the other committed folders (1xH200-nccl, ...): the committed records,
  copied (every checkout has them, and a chapter may read them beside the server's);
- <gpus>x<GPU>-nccl/: every experiment that trains on the GPUs, run by the package itself:
  `experiments.run_experiment` over the lists `EXPERIMENTS` makes for a `torch.cuda` that
  claims the GPUs (`fake_cuda`), through `launch` (the one device plan, DataParallel's note,
  the record file it reads back), the worker's `build_record` and `records.provenance`. The
  one thing stood in for is what runs inside the torchrun workers: `gpu_train_result` gives
  each rank what `train.train` returns on the GPU path, and `GpuWorkers` folds the ranks into
  `record.json` as `worker.main` does. With `fails`, the runs it picks fail in their workers
  instead (as every pipeline did on NCCL before ad8000d): the package then writes what a
  partly failed `make figures` leaves, some experiments missing or short. With `stopped`,
  `make figures` was stopped during those experiments (their files keep the runs before);
- cpu-32core-gloo/: the experiments that run on the CPU over gloo whatever the machine
  (everything `run_spmd` starts, the stale-gradient replay, the multi-process experiments on
  one GPU, the compositions below 8 GPUs). A server files them under its own CPU's tag; here
  they are the committed measurements with the provenance `records.provenance` gives on a
  32-core CPU.

Numbers are plausible, not predicted: each GPU run is scaled from the committed CPU record
of the same setting (`template`), with the rules in `gpu_train_result`; the GPUs' relations
between precisions are typical ones (`GPU_SPEEDS`), not the CPU's.

The processes a test starts (notebook kernels) see the same fake GPUs through
tests/fake_cuda/sitecustomize.py (`kernel_env`).

Run as a script to write such a folder, and point MULTIGPU_RESULTS at it to read the
chapters against it (tests/test_gpu_chapters.py does, chapter by chapter, for the servers of
SERVERS: 1, 2 and 3 GPUs, a partial folder of 3, and 8):

    python tests/gpu_shaped.py --gpus 8 /tmp/gpu-results
    python tests/gpu_shaped.py --gpus 3 --name "Tesla V100-SXM2-32GB" --partial /tmp/gpu-partial
    PYTHONPATH=tests/fake_cuda MULTIGPU_FAKE_CUDA="8:NVIDIA H100 80GB HBM3" MULTIGPU_RESULTS=/tmp/gpu-results \
        jupyter lab book/   # the chapters, as on that server (live cells cannot run)
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import math
import os
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fake_cuda.sitecustomize import CPUS_ENV, cublas_workspace_size, patches
from fake_cuda.sitecustomize import ENV as FAKE_CUDA_ENV
from fake_cuda.sitecustomize import GPUS as FAKE_GPUS
from multigpu import experiments, records, runtime
from multigpu.comm import sent_bytes
from multigpu.config import ZERO_STAGE, RunConfig
from multigpu.memory import CATEGORIES
from multigpu.models import GPT_SIZES, default_seq_len, parameter_count
from multigpu.strategies.dp import GPUDataParallel

launch_module = importlib.import_module("multigpu.launch")  # the package's `launch` is the function
limits_module = importlib.import_module("multigpu.experiments.limits")

TESTS = Path(__file__).resolve().parent
COMMITTED = TESTS.parent / "results" / "cpu-2core-gloo"
FAKE_CUDA_SITE = TESTS / "fake_cuda"  # its sitecustomize.py fakes CUDA in processes started with it on PYTHONPATH
H100, A100, V100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"
GPU_NAME = H100
SERVER_CORES = 32

# How a GPU run's numbers are scaled from its CPU template (plausible, not predicted):
# per GPU, its fp32 speed over this 2-core CPU's per unit of work (parameters x tokens), and
# a mixed-precision step's time over fp32's on it: tensor cores for bf16 and fp16 on A100 and
# H100; on a V100 for fp16 only, bf16 emulated (slower than fp32)
GPU_SPEEDS = {
    H100: (300, {"bf16-mixed": 0.45, "fp16-mixed": 0.45}),
    A100: (150, {"bf16-mixed": 0.5, "fp16-mixed": 0.5}),
    V100: (60, {"bf16-mixed": 1.4, "fp16-mixed": 0.55}),
}
ALLOCATOR_SLACK = 1.1  # the caching allocator's rounding and fragmentation over the tensors alive


def pipelines_fail(experiment: str, cfg: RunConfig) -> str | None:
    """`fails` for a partly failed `make figures`: every pipeline run dies in its workers, as
    they all did on NCCL before ad8000d (review G2), and so does every run of tp_scaling:
    what is left is a partial GPU folder without pp_schedules, pp_memory and tp_scaling (the
    chapters take those from the committed CPU's) and, on 8 GPUs, compositions without their
    pipelines. (Where only tp_scaling's tensor-parallel runs fail, as on 3, 5, 6 or 7 GPUs
    before tp_degrees, review G5, its file keeps the one-GPU run alone, and tp.md, which reads
    the richest machine's, finds no tp run to compare: not modelled here.)"""
    if cfg.strategy.startswith("pp-"):
        return "RuntimeError: No backend type associated with device type cpu"
    if experiment == "tp_scaling":
        return "RuntimeError: interrupted"
    return None


# where the partial server's `make figures` was stopped (a job's time limit, Ctrl-C) and run again for the
# experiments after: experiment -> the runs that had finished. A file then holds only those, and a chapter reads
# them as that machine's (machine_limits: none, its step profiles have no measured peak; compositions: the single
# device alone; checkpoint_bytes: one device and DDP, on the server's CPU; dp_vs_ddp: no DataParallel at the
# larger batch)
STOPPED = {"machine_limits": 0, "compositions": 1, "checkpoint_bytes": 2, "dp_vs_ddp": 3}


class Interrupted(BaseException):
    """`make figures` stopped during an experiment (what KeyboardInterrupt does to it)."""


class RunsOnTheCPU(BaseException):
    """This item runs on the CPU even on a GPU server. A BaseException, like
    KeyboardInterrupt, so that run_experiment's per-item error handling lets it through."""


@functools.cache
def _parameters(model: str) -> int:
    return parameter_count(model)


def _dims(model: str) -> tuple[int, int, int]:
    """(blocks, width, vocabulary) of a GPT or T5 preset."""
    if model in GPT_SIZES:
        c = GPT_SIZES[model]
        return c.n_layer, c.d_model, c.vocab_size
    from multigpu.models import t5_config

    c = t5_config(model)
    return 2 * c.num_layers, c.d_model, c.vocab_size


def _token_width(model: str) -> int:
    """What one token's activations grow with: every block's width, and the logits."""
    blocks, width, vocab = _dims(model)
    return blocks * width + vocab


def _resized(values: list, n: int) -> list:
    """The first n values, the last one repeated if there are fewer."""
    return (list(values) + [values[-1]] * n)[:n]


def training_records(folder: Path) -> list[dict]:
    """The committed records of training runs (not jobs' measurements): the templates."""
    found = []
    for path in sorted(folder.glob("*.jsonl")):
        found += [r for r in records.read_records(path) if "loss" in r and "step_times_s_by_rank" in r]
    return found


def template(cfg: RunConfig, experiment: str | None, candidates: list[dict]) -> dict:
    """The committed CPU record closest to `cfg`: same strategy, then the same experiment,
    the fewest other settings changed (model and sizes aside), the nearest world size,
    per-rank batch and sequence length."""
    # sizes, and where and how often a run saves (a temporary folder's name; the steps between saves scale with
    # the run): whether it saves at all is compared below
    sizes = {"model", "global_batch_size", "seq_len", "device", "threads_per_worker", "world_size",
             "checkpoint_dir", "checkpoint_every"}
    mine = {k: v for k, v in cfg.to_dict().items() if k not in sizes}
    seq = cfg.seq_len or default_seq_len(cfg.model)

    def distance(r):
        c = RunConfig.from_dict(r["config"])
        changed = sum(r["config"].get(k) != v for k, v in mine.items()) + (
            bool(r["config"].get("checkpoint_dir")) != bool(cfg.checkpoint_dir))
        return (r.get("experiment") != experiment, changed, abs(math.log(c.world_size / cfg.world_size)),
                abs(math.log(c.per_rank_batch_size / cfg.per_rank_batch_size)), abs(math.log(r["seq_len"] / seq)))

    same = [r for r in candidates if r["config"]["strategy"] == cfg.strategy]
    assert same, f"no committed CPU record of {cfg.strategy} to scale a GPU run from"
    return min(same, key=distance)


def _cut(cfg: RunConfig, cpu: RunConfig) -> dict[str, float]:
    """A GPU rank's share of each model state over the template rank's: states cut along tp
    and pp shrink with those degrees, and along dp as far as the strategy's ZeRO stage cuts."""
    d, t = cfg.degrees, cpu.degrees
    whole = t["tp"] * t["pp"] / (d["tp"] * d["pp"])
    stage, dp = ZERO_STAGE.get(cfg.strategy) or 0, t["dp"] / d["dp"]
    return {"params": whole * (dp if stage >= 3 else 1), "grads": whole * (dp if stage >= 2 else 1),
            "optimizer": whole * (dp if stage >= 1 else 1)}


def offloads(cfg: RunConfig) -> bool:
    """Whether DeepSpeed keeps this run's optimizer state on the host."""
    return "offload_optimizer" in cfg.extra.get("zero_optimization", {})


def without_offload(cfg: RunConfig) -> RunConfig:
    zero = {k: v for k, v in cfg.extra.get("zero_optimization", {}).items() if k != "offload_optimizer"}
    extra = {k: v for k, v in cfg.extra.items() if k != "zero_optimization"}
    return cfg.replace(extra=extra | ({"zero_optimization": zero} if zero else {}))


def gpu_train_result(cfg: RunConfig, rank: int, cpu_record: dict, held_like: dict | None = None,
                     timed_like: dict | None = None, gpu: str = GPU_NAME) -> dict:
    """What `train.train` returns on rank `rank` of a GPU run of `cfg` on GPUs named `gpu` (its
    keys, and which of them the GPU path leaves None), with numbers scaled from `cpu_record`, a
    CPU run of the same setting:

    - model states and memory categories: by the parameters, and by what the rank's share
      of a sharded state changes with the degrees (`_cut`); activations by the tokens of a
      micro-batch times `_token_width`. The memory of an offloading run is that of `held_like`,
      the CPU run without offload (on a CPU the host's buffers count as the device's), less
      the optimizer state, which stays on the host;
    - the allocator's peak: the tensors alive, plus slack and the cuBLAS workspaces (two, of
      the size torch chooses for the GPU's architecture);
    - times: by parameters x tokens, over the GPU's speed (GPU_SPEEDS), from `timed_like`, the
      CPU run in fp32 where `cfg` is in mixed precision, times the GPU's mixed-precision factor
      (a CPU's relation between precisions is not a GPU's); the loss: the CPU run's;
    - collectives: the same calls; payloads as `carried` says; bytes sent by the ring rule,
      as CommCounter counts them;
    - the loopback: None (train measures it over gloo only);
    - the strategy's report: the CPU run's, except DataParallel's, which on GPUs is
      GPUDataParallel.report (allocator peaks per device, categories None)."""
    cpu = RunConfig.from_dict(cpu_record["config"])
    ranks = len(cpu_record["step_times_s_by_rank"])
    r = rank % ranks  # the template rank in the same place
    seq = cfg.seq_len or default_seq_len(cfg.model)
    params = _parameters(cfg.model) / cpu_record["parameters"]
    tokens = cfg.micro_batch_size * seq / (cpu.micro_batch_size * cpu_record["seq_len"])
    activations = tokens * _token_width(cfg.model) / _token_width(cpu.model)
    timed = timed_like or cpu_record
    speed, mixed = GPU_SPEEDS[gpu]
    seconds = (_parameters(cfg.model) / timed["parameters"] * cfg.per_rank_batch_size * seq
               / (RunConfig.from_dict(timed["config"]).per_rank_batch_size * timed["seq_len"]) / speed
               * mixed.get(cfg.dtype, 1))
    workspaces = 2 * cublas_workspace_size(FAKE_GPUS[gpu][1])
    cut = _cut(cfg, cpu)
    on_host = offloads(cfg)

    model_states = {c: int(v * params * cut[c]) for c, v in cpu_record["model_state_bytes_by_rank"][r].items()}
    measured = (held_like or cpu_record)["peak_memory_bytes_by_rank"][r]
    saved = (held_like or cpu_record)["saved_activation_bytes_by_rank"][r]
    own_memory = cfg.info.one_process or measured["total"] is None  # dp on GPUs; the library's pipelines
    if own_memory:
        memory, saved = dict.fromkeys([*CATEGORIES, "total"]), None
    else:
        memory = {c: int(measured[c] * (params * cut[c] if c in cut else activations)) for c in CATEGORIES}
        if on_host:
            memory["optimizer"] = 0
        memory["total"] = sum(memory.values())
        saved = int(saved * activations)
    on_device = sum(v for c, v in model_states.items() if not (on_host and c == "optimizer"))
    allocator_peak = int((memory["total"] or on_device + (saved or 0)) * ALLOCATOR_SLACK) + workspaces

    hidden = tokens * _dims(cfg.model)[1] / _dims(cpu.model)[1]  # a (batch, sequence, width) tensor

    def carried(kind: str) -> float:
        """What a collective's payload grows with: activations between tensor-parallel ranks and
        pipeline stages, parameters (or their gradients) otherwise; an all-gather's is a shard."""
        activation = cfg.info.spans == "tp" or (cfg.info.spans == "pp" and kind in ("send", "recv"))
        return (hidden if activation else params) * (cpu.world_size / cfg.world_size if kind == "all_gather" else 1)

    payload = {k: int(v * carried(k)) for k, v in cpu_record["comm_payload_bytes_per_step_by_rank"][r].items()}
    sent = {k: sent_bytes(k, v, cfg.processes) for k, v in payload.items()}  # as CommCounter counts them

    timed_rank = timed["step_times_s_by_rank"][rank % len(timed["step_times_s_by_rank"])]
    times = [t * seconds for t in _resized(timed_rank, cfg.steps)]
    untracked = times[3:]  # train times the steps after the tracked (0, 1) and counted (2) ones
    by_rank = cpu_record.get("strategy_report_by_rank")
    report = copy.deepcopy(by_rank[r] if by_rank else cpu_record["strategy_report"] if rank == 0 else {})
    if cfg.info.one_process:  # DataParallel: this process's device is the primary
        report = _data_parallel_report(cfg, cpu_record, params, activations, workspaces)
        allocator_peak = report["peak_memory_bytes_by_replica"][0]["total"]
    profile = None  # the CPU run's profiled step, at the GPU's pace (a GPU's categories are typical, not these)
    if cfg.extra.get("profile") and cpu_record.get("profile_by_rank"):
        cpu_profile = cpu_record["profile_by_rank"][r]
        scale = times[-1] / cpu_profile["seconds"]["step"]
        profile = {"seconds": {k: {c: {op: t * scale for op, t in ops.items()} for c, ops in v.items()}
                               if k == "largest" else v * scale for k, v in cpu_profile["seconds"].items()},
                   "timeline": {k: v if k == "hidden" else [[a * scale, b * scale] for a, b in v]
                                for k, v in cpu_profile["timeline"].items()},
                   "trace": None}
    return {
        "rank": rank,
        "loss": _resized(cpu_record["loss"], cfg.steps),
        "profile": profile,
        "step_times_s": times,
        "step_time_s": statistics.median(untracked or times),
        "timed_steps": len(untracked) or len(times),
        "step_time_includes_tracking": not untracked,
        "model_states": model_states,
        "memory": memory,
        "saved_activation_bytes": saved,
        "cuda_allocator_peak_bytes": allocator_peak,
        # as memory.ProcessPeaks reports the allocator's peaks (the model is built after the baseline);
        # reserved: what it took from the GPU, in the large pool's 20 MiB segments
        "process_peak": {"instrument": "cuda caching allocator", "baseline_bytes": 0, "peak_bytes": allocator_peak,
                         "peak_bytes_by_step": [allocator_peak] * cfg.steps,
                         "reserved_bytes": -(-allocator_peak // (20 * 2**20)) * 20 * 2**20},
        "comm_calls": dict(cpu_record["comm_calls_per_step_by_rank"][r]),
        "comm_payload_bytes": payload,
        "comm_sent_bytes": sent,
        "loopback_bytes": None,
        "strategy_report": report,
        "state_dict": None,
        "seq_len": seq,
        "parameters": _parameters(cfg.model),
        "moe": copy.deepcopy(cpu_record.get("moe")),  # a mixture of experts' routing, as the CPU run routed
        # the CPU run's saves (what they wrote, what they cost), where the config saves
        "checkpoint": {"saves": copy.deepcopy(cpu_record["checkpoint"]["saves"][r])
                       if cfg.checkpoint_dir and "checkpoint" in cpu_record else [], "resumed": None},
    }


def _data_parallel_report(cfg: RunConfig, cpu_record: dict, params: float, activations: float,
                          workspaces: int) -> dict:
    """GPUDataParallel.report itself, each device's allocator peak scaled from what the
    from-scratch version counted on that replica (the primary, or any other)."""
    def peak(held: dict) -> int:
        tensors = sum(held[c] * (params if c in ("params", "grads", "optimizer") else activations) for c in CATEGORIES)
        return int(tensors * ALLOCATOR_SLACK) + workspaces

    held = cpu_record["peak_memory_bytes_by_rank"]
    peaks = [peak(held[min(i, len(held) - 1)]) for i in range(cfg.world_size)]
    devices = [torch.device("cuda", i) for i in range(cfg.world_size)]
    replicas = SimpleNamespace(replicas=cfg.world_size, implementation=GPUDataParallel.implementation,
                               peak_devices=devices)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "max_memory_allocated",
                   lambda device=None: peaks[device if isinstance(device, int) else torch.device(device).index])
        return GPUDataParallel.report(replicas, optimizer=None)


class GpuWorkers:
    """Stands in for `launch.run_torchrun`: what the torchrun workers of a GPU server
    would leave behind. A training run on the GPUs writes record.json (and params.pt) as
    `worker.main` does; anything that would run on the CPU raises RunsOnTheCPU. A run that
    `fails(experiment, cfg)` picks fails as its workers would, with that error: no record, a
    non-zero exit."""

    def __init__(self, templates: list[dict], gpu: str = GPU_NAME, fails=None, stopped: dict | None = None):
        self.templates, self.gpu, self.fails, self.stopped = templates, gpu, fails, stopped or {}
        self.runs: dict[str, int] = {}  # experiment -> runs started on the GPUs
        self.experiment: str | None = None  # the experiment being written: its templates come first
        self.failed: dict[str, int] = {}  # experiment -> runs made to fail

    def __call__(self, args: list[str], *, processes: int, **_) -> tuple[int, list[str]]:
        from multigpu.worker import build_record

        if args[:2] != ["-m", "multigpu.worker"]:  # run_spmd: always gloo on the CPU
            raise RunsOnTheCPU(" ".join(args[:3]))
        options = dict(zip(args[2::2], args[3::2]))
        if options["--device"] != "cuda":
            raise RunsOnTheCPU(f"a run on {options['--device']}")
        cfg = RunConfig.from_dict(json.loads(Path(options["--config"]).read_text()))
        self.runs[self.experiment] = self.runs.get(self.experiment, 0) + 1
        if self.runs[self.experiment] > self.stopped.get(self.experiment, math.inf):
            raise Interrupted(self.experiment)
        error = self.fails and self.fails(self.experiment, cfg)
        if error:
            self.failed[self.experiment] = self.failed.get(self.experiment, 0) + 1
            return 1, ["[rank0]: Traceback (most recent call last):", f"[rank0]: {error}"]
        cpu_record = template(cfg, self.experiment, self.templates)
        held_like = template(without_offload(cfg), self.experiment, self.templates) if offloads(cfg) else None
        timed_like = template(cfg.replace(dtype="fp32"), self.experiment, self.templates) if cfg.dtype != "fp32" \
            else None
        results = [gpu_train_result(cfg, rank, cpu_record, held_like, timed_like, self.gpu)
                   for rank in range(processes)]
        for result in results:
            result.pop("state_dict")  # the worker keeps it out of what the ranks exchange
        rt = runtime.Runtime(rank=0, local_rank=0, world_size=processes, device=torch.device("cuda", 0),
                             backend="nccl")
        out = Path(options["--out"])
        (out / "record.json").write_text(json.dumps(build_record(cfg, rt, results)))
        if "--save-params" in args:  # check() compares the weights: the same ones, as parity promises
            torch.save({"weight": torch.zeros(1)}, out / "params.pt")
        return 0, []


def fake_cuda(mp: pytest.MonkeyPatch, gpus: int, name: str = GPU_NAME, cores: int = SERVER_CORES) -> None:
    """Make this process a server with `gpus` GPUs named `name` and `cores` CPU cores, as far
    as the package asks (tests/fake_cuda/sitecustomize.py's table), and lift the test suite's
    CPU pin (MULTIGPU_DEVICE=cpu, tests/conftest.py): on a GPU server nothing sets it, so
    `auto` means what the one device plan makes of the GPUs."""
    for obj, attribute, fake in patches(gpus, name):
        mp.setattr(obj, attribute, fake)
    mp.setattr(os, "cpu_count", lambda: cores)
    mp.delenv(runtime.DEVICE_ENV, raising=False)


def kernel_env(mp: pytest.MonkeyPatch, gpus: int, name: str = GPU_NAME) -> None:
    """The same server for the processes started from now on (a notebook kernel): the fake
    CUDA by environment (tests/fake_cuda/sitecustomize.py, on PYTHONPATH), the server's CPU
    cores, and no CPU pin."""
    mp.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_CUDA_SITE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    mp.setenv(FAKE_CUDA_ENV, f"{gpus}:{name}")
    mp.setenv(CPUS_ENV, str(SERVER_CORES))
    mp.delenv(runtime.DEVICE_ENV, raising=False)


def _replay_on_the_cpu(*args, **kwargs):
    """Stands in for the stale-gradient replay, which trains in this process, on the CPU."""
    raise RunsOnTheCPU("the stale-gradient replay")


# the fake GPUs' dense peaks (FLOP/s) where multigpu.experiments.limits.datasheet names none (a V100: fp16 tensor
# cores, no bf16 ones)
V100_PEAKS = {"fp32": 15.7e12, "tf32": 15.7e12, "bf16": 15.7e12, "fp16": 125e12}


def _gpu_matmul_rates(device: str, dtype: str, threads, sizes, **_) -> list[dict]:
    """Stands in for the matmul sweep on the fake GPUs: each size's rate rising towards 80% of the dense peak, as a
    real sweep's does (the ML Engineering book measured 80.3% on an H100)."""
    sheet = limits_module.datasheet(torch.cuda.get_device_name(0)) or V100_PEAKS
    rows = []
    for n in sizes:
        rate = 0.8 * sheet[dtype] * n**2 / (n**2 + 2048**2)
        rows.append({"kind": "matmul", "device": "cuda", "dtype": dtype, "threads": threads, "n": n,
                     "flops": 2 * n**3, "best_flops_per_s": rate, "median_flops_per_s": 0.97 * rate, "calls": 10})
    return rows


def _gpu_memory_rate(device: str, threads, size_bytes: int) -> dict:
    """Stands in for the copy on the fake GPUs: 2.5 TB/s, an H100's HBM3 as a copy reaches it."""
    return {"kind": "memory", "device": "cuda", "threads": threads, "bytes": 2 * size_bytes,
            "best_bytes_per_s": 2.5e12, "median_bytes_per_s": 2.4e12, "calls": 10}


def _refile_on_server_cpu(experiment: str, folder: Path, runs: int | None = None) -> None:
    """The committed records of an experiment that runs on the CPU, as the server's CPU files them
    (the first `runs` of them: where `make figures` was stopped)."""
    rewritten = []
    for r in records.read_records(COMMITTED / f"{experiment}.jsonl")[:runs]:
        p = r["provenance"]
        server = records.provenance(p["backend"], p["world_size"], "cpu", p["threads_per_worker"])
        rewritten.append({**r, "provenance": server})
    records.write_records(folder / records.machine_tag("cpu") / f"{experiment}.jsonl", rewritten)


def write_gpu_results(folder: Path, gpus: int, name: str = GPU_NAME, fails=None, stopped: dict | None = None) -> str:
    """Write into `folder` the results/ of a server with `gpus` GPUs named `name` after `make
    figures` (see the module's docstring); return the GPU machine tag. `fails(experiment,
    cfg)`: an error message for the runs that fail in their workers, else None. `stopped`:
    experiment -> the runs that finished before `make figures` was stopped during it. Raises
    ExperimentFailed, after writing everything, if any other run failed."""
    for committed in committed_tags():
        shutil.copytree(COMMITTED.parent / committed, folder / committed)
    workers = GpuWorkers(training_records(COMMITTED), name, fails, stopped)
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, gpus, name)
        mp.setattr(records, "RESULTS_DIR", folder)
        mp.setattr(launch_module, "run_torchrun", workers)
        mp.setattr(importlib.import_module("multigpu.asynchronous"), "train_with_stale_gradients", _replay_on_the_cpu)
        mp.setattr(limits_module, "matmul_rates", _gpu_matmul_rates)
        mp.setattr(limits_module, "memory_rate", _gpu_memory_rate)
        tag, unexpected = records.machine_tag(), []
        for experiment in experiments.EXPERIMENTS:
            workers.experiment = experiment
            if (stopped or {}).get(experiment) == 0:
                continue  # stopped before its first run finished: no file
            try:
                experiments.run_experiment(experiment, progress=False)
            except RunsOnTheCPU:
                assert not (folder / tag / f"{experiment}.jsonl").exists(), f"{experiment} ran partly on the GPUs"
                _refile_on_server_cpu(experiment, folder, (stopped or {}).get(experiment))
            except Interrupted:
                pass  # its file keeps the runs that finished (run_experiment writes after every run)
            except experiments.ExperimentFailed as err:  # "<name>: <k> of <n> run(s) failed: ..."
                if int(str(err).split(": ", 1)[1].split(" of ")[0]) != workers.failed.get(experiment):
                    unexpected.append(str(err))
    if unexpected:
        raise experiments.ExperimentFailed("\n".join(unexpected))
    return tag


# the servers the tests write results for: name -> (GPUs, their name, the runs that fail in their workers, where
# `make figures` was stopped). 1, 2
# and 3 GPUs, complete; 3 whose pipelines and tensor-parallel runs failed (partial: chapters then mix the GPU's
# records with the committed CPU's); 8, the one where the compositions run on the GPUs
SERVERS = {
    "1xA100": (1, A100, None, None),
    "2xH100": (2, H100, None, None),
    "3xA100": (3, A100, None, None),
    "3xV100-partial": (3, V100, pipelines_fail, STOPPED),
    "8xH100": (8, H100, None, None),
}
_WRITTEN: dict[tuple[Path, str], tuple[Path, str]] = {}


def server_results(server: str, tmp_path_factory) -> tuple[Path, str]:
    """(folder, GPU tag): results/ as `server` (SERVERS) leaves it, written once per session
    (one folder per server, whichever test module asks first)."""
    key = (tmp_path_factory.getbasetemp(), server)
    if key not in _WRITTEN:
        folder = tmp_path_factory.mktemp(f"results-{server}")
        _WRITTEN[key] = folder, write_gpu_results(folder, *SERVERS[server])
    return _WRITTEN[key]


def committed_tags() -> list[str]:
    """The machine folders of results/ that the checkout commits (git tracks them); without
    git, the one this module copies."""
    import subprocess

    try:
        tracked = subprocess.run(["git", "-C", str(COMMITTED.parents[1]), "ls-files", "--", "results"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        tracked = []
    return sorted({Path(path).parts[1] for path in tracked if len(Path(path).parts) > 2}) or [COMMITTED.name]


_VIEWS: dict[Path, Path] = {}


def only_committed_records(mp: pytest.MonkeyPatch, tmp_path_factory) -> Path:
    """Make `records` (this process's RESULTS_DIR) and the processes started from now on
    (MULTIGPU_RESULTS) read the committed records only: a folder that links to each committed
    machine folder and nothing else. A results/<gpu-tag>/ (or another CPU's folder) that `make
    figures` wrote beside them is then not what a test about the committed records reads
    (review G4b). The folder is made once per session."""
    base = tmp_path_factory.getbasetemp()
    if base not in _VIEWS:
        view = tmp_path_factory.mktemp("committed-results")
        for tag in committed_tags():
            (view / tag).symlink_to(COMMITTED.parent / tag, target_is_directory=True)
        _VIEWS[base] = view
    mp.setattr(records, "RESULTS_DIR", _VIEWS[base])
    mp.setenv("MULTIGPU_RESULTS", str(_VIEWS[base]))
    return _VIEWS[base]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a new folder: MULTIGPU_RESULTS for the chapters")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--name", default=GPU_NAME, choices=list(GPU_SPEEDS), help="the GPUs' name")
    parser.add_argument("--partial", action="store_true",
                        help="the pipelines and tp_scaling's tensor-parallel runs fail (pipelines_fail), and "
                             "`make figures` was stopped during the experiments of STOPPED")
    args = parser.parse_args()
    print(write_gpu_results(args.folder, args.gpus, args.name, *(pipelines_fail, STOPPED) if args.partial else ()))


if __name__ == "__main__":
    main()
