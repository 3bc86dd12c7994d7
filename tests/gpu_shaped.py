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
of the same setting (`template`), with the rules in `gpu_train_result` (both in
tests/gpu_scaled.py); the GPUs' relations between precisions are typical ones (`GPU_SPEEDS`),
not the CPU's.

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
import importlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from fake_cuda.sitecustomize import CPUS_ENV, patches
from fake_cuda.sitecustomize import ENV as FAKE_CUDA_ENV
from gpu_scaled import (  # noqa: F401 - the tests import the scaling rules from here too
    A100,
    GPU_NAME,
    GPU_SPEEDS,
    H100,
    V100,
    gpu_train_result,
    offloads,
    template,
    training_records,
    without_offload,
)
from multigpu import experiments, records, runtime
from multigpu.config import RunConfig

launch_module = importlib.import_module("multigpu.launch")  # the package's `launch` is the function
limits_module = importlib.import_module("multigpu.experiments.limits")

TESTS = Path(__file__).resolve().parent
COMMITTED = TESTS.parent / "results" / "cpu-2core-gloo"
FAKE_CUDA_SITE = TESTS / "fake_cuda"  # its sitecustomize.py fakes CUDA in processes started with it on PYTHONPATH
SERVER_CORES = 32



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
        given = json.loads(Path(options["--config"]).read_text())
        if isinstance(given, list):  # a series (launch.launch_series): each run's record in run<i>/, in order
            out = Path(options["--out"])
            for i, one in enumerate(given):
                (out / f"run{i}").mkdir(exist_ok=True)
                (out / f"run{i}" / "config.json").write_text(json.dumps(one))
                run_args = [*args[:2], *(x for k, v in options.items()
                                         for x in (k, str(out / f"run{i}" / "config.json") if k == "--config"
                                                   else str(out / f"run{i}") if k == "--out" else v))]
                rc, tail = self(run_args + (["--save-params"] if "--save-params" in args else []), processes=processes)
                if rc:
                    return rc, tail
            return 0, []
        cfg = RunConfig.from_dict(given)
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
