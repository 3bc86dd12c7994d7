"""GPU-shaped records, written without a GPU: what `make figures` leaves in results/ on a
server with 2 or 8 CUDA GPUs, made by the code that writes them there.

    tag = write_gpu_results(folder, gpus=8)   # -> "8xH100-nccl"

`folder` then holds, as a server's results/ would after `make figures`:

- cpu-2core-gloo/: the committed records, copied (every checkout has them);
- <gpus>xH100-nccl/: every experiment that trains on the GPUs, run by the package itself:
  `experiments.run_experiment` over the lists `EXPERIMENTS` makes for a `torch.cuda` that
  claims the GPUs, through `launch` (its device choice, DataParallel's note, the record
  file it reads back), the worker's `build_record` and `records.provenance`. The one thing
  stood in for is what runs inside the torchrun workers: `gpu_train_result` gives each rank
  what `train.train` returns on the GPU path, and `GpuWorkers` folds the ranks into
  `record.json` as `worker.main` does;
- cpu-32core-gloo/: the experiments that run on the CPU over gloo whatever the machine
  (everything `run_spmd` starts, the stale-gradient replay, the compositions below 8 GPUs).
  A server files them under its own CPU's tag; here they are the committed measurements
  with the provenance `records.provenance` gives on a 32-core CPU.

Numbers are plausible, not predicted: each GPU run is scaled from the committed CPU record
of the same setting (`template`), with the rules in `gpu_train_result`.

Run as a script to write such a folder, and point MULTIGPU_RESULTS at it to read the
chapters against it (tests/test_gpu_shaped.py does, chapter by chapter):

    python tests/gpu_shaped.py --gpus 8 /tmp/gpu-results
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

from multigpu import experiments, records, runtime
from multigpu.comm import sent_bytes
from multigpu.config import ZERO_STAGE, RunConfig
from multigpu.memory import CATEGORIES
from multigpu.models import GPT_SIZES, default_seq_len, parameter_count
from multigpu.strategies.dp import GPUDataParallel

launch_module = importlib.import_module("multigpu.launch")  # the package's `launch` is the function
check_module = importlib.import_module("multigpu.check")

COMMITTED = Path(__file__).resolve().parents[1] / "results" / "cpu-2core-gloo"
GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_MEMORY_BYTES = 85_029_158_912  # what torch.cuda.get_device_properties reports for an H100 80GB
CUDA_CONTEXT_BYTES = 536_870_912  # what the CUDA context takes of it before any tensor (about 500 MiB)
SERVER_CORES = 32
# the GPU path as the package defines it: tests/conftest.py replaces these in every test
# (device "auto" means the CPU there), so they are kept from before any test ran
GPU_PATH = {(experiments, "on_gpus"): experiments.on_gpus,
            (runtime, "choose_device"): runtime.choose_device,
            (check_module, "choose_device"): check_module.choose_device}
assert all(f.__module__.startswith("multigpu.") for f in GPU_PATH.values()), "imported while a test patched them"

# How a GPU run's numbers are scaled from its CPU template (plausible, not predicted):
GPU_SPEEDUP = 300  # an H100 in fp32 against this 2-core CPU, per unit of work (parameters x tokens)
ALLOCATOR_SLACK = 1.1  # the caching allocator's rounding and fragmentation over the tensors alive
CUBLAS_WORKSPACES = 2 * 32 * 2**20  # one 32 MiB workspace for forward's thread, one for autograd's (review F4)


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
    sizes = {"model", "global_batch_size", "seq_len", "device", "threads_per_worker", "world_size"}
    mine = {k: v for k, v in cfg.to_dict().items() if k not in sizes}
    seq = cfg.seq_len or default_seq_len(cfg.model)

    def distance(r):
        c = RunConfig.from_dict(r["config"])
        changed = sum(r["config"].get(k) != v for k, v in mine.items())
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


def gpu_train_result(cfg: RunConfig, rank: int, cpu_record: dict, held_like: dict | None = None) -> dict:
    """What `train.train` returns on rank `rank` of a GPU run of `cfg` (its keys, and which of
    them the GPU path leaves None), with numbers scaled from `cpu_record`, a CPU run of the same
    setting:

    - model states and memory categories: by the parameters, and by what the rank's share
      of a sharded state changes with the degrees (`_cut`); activations by the tokens of a
      micro-batch times `_token_width`. The memory of an offloading run is that of `held_like`,
      the CPU run without offload (on a CPU the host's buffers count as the device's), less
      the optimizer state, which stays on the host;
    - the allocator's peak: the tensors alive, plus slack and the cuBLAS workspaces;
    - times: by parameters x tokens, over GPU_SPEEDUP; the loss: the CPU run's;
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
    seconds = params * cfg.per_rank_batch_size * seq / (cpu.per_rank_batch_size * cpu_record["seq_len"]) / GPU_SPEEDUP
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
    allocator_peak = int((memory["total"] or on_device + (saved or 0)) * ALLOCATOR_SLACK) + CUBLAS_WORKSPACES

    hidden = tokens * _dims(cfg.model)[1] / _dims(cpu.model)[1]  # a (batch, sequence, width) tensor

    def carried(kind: str) -> float:
        """What a collective's payload grows with: activations between tensor-parallel ranks and
        pipeline stages, parameters (or their gradients) otherwise; an all-gather's is a shard."""
        activation = cfg.info.spans == "tp" or (cfg.info.spans == "pp" and kind in ("send", "recv"))
        return (hidden if activation else params) * (cpu.world_size / cfg.world_size if kind == "all_gather" else 1)

    payload = {k: int(v * carried(k)) for k, v in cpu_record["comm_payload_bytes_per_step_by_rank"][r].items()}
    sent = {k: sent_bytes(k, v, cfg.processes) for k, v in payload.items()}  # as CommCounter counts them

    times = [t * seconds for t in _resized(cpu_record["step_times_s_by_rank"][r], cfg.steps)]
    untracked = times[3:]  # train times the steps after the tracked (0, 1) and counted (2) ones
    by_rank = cpu_record.get("strategy_report_by_rank")
    report = copy.deepcopy(by_rank[r] if by_rank else cpu_record["strategy_report"] if rank == 0 else {})
    if cfg.info.one_process:  # DataParallel: this process's device is the primary
        report = _data_parallel_report(cfg, cpu_record, params, activations)
        allocator_peak = report["peak_memory_bytes_by_replica"][0]["total"]
    return {
        "rank": rank,
        "loss": _resized(cpu_record["loss"], cfg.steps),
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
    }


def _data_parallel_report(cfg: RunConfig, cpu_record: dict, params: float, activations: float) -> dict:
    """GPUDataParallel.report itself, each device's allocator peak scaled from what the
    from-scratch version counted on that replica (the primary, or any other)."""
    def peak(held: dict) -> int:
        tensors = sum(held[c] * (params if c in ("params", "grads", "optimizer") else activations) for c in CATEGORIES)
        return int(tensors * ALLOCATOR_SLACK) + CUBLAS_WORKSPACES

    held = cpu_record["peak_memory_bytes_by_rank"]
    peaks = [peak(held[min(i, len(held) - 1)]) for i in range(cfg.world_size)]
    replicas = SimpleNamespace(replicas=cfg.world_size, implementation=GPUDataParallel.implementation)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "max_memory_allocated", lambda device: peaks[device])
        return GPUDataParallel.report(replicas, optimizer=None)


class GpuWorkers:
    """Stands in for `launch.run_torchrun`: what the torchrun workers of a GPU server
    would leave behind. A training run on the GPUs writes record.json (and params.pt) as
    `worker.main` does; anything that would run on the CPU raises RunsOnTheCPU."""

    def __init__(self, templates: list[dict]):
        self.templates = templates
        self.experiment: str | None = None  # the experiment being written: its templates come first

    def __call__(self, args: list[str], *, processes: int, **_) -> tuple[int, list[str]]:
        from multigpu.worker import build_record

        if args[:2] != ["-m", "multigpu.worker"]:  # run_spmd: always gloo on the CPU
            raise RunsOnTheCPU(" ".join(args[:3]))
        options = dict(zip(args[2::2], args[3::2]))
        if options["--device"] != "cuda":
            raise RunsOnTheCPU(f"a run on {options['--device']}")
        cfg = RunConfig.from_dict(json.loads(Path(options["--config"]).read_text()))
        cpu_record = template(cfg, self.experiment, self.templates)
        held_like = template(without_offload(cfg), self.experiment, self.templates) if offloads(cfg) else None
        results = [gpu_train_result(cfg, rank, cpu_record, held_like) for rank in range(processes)]
        for result in results:
            result.pop("state_dict")  # the worker keeps it out of what the ranks exchange
        rt = runtime.Runtime(rank=0, local_rank=0, world_size=processes, device=torch.device("cuda", 0),
                             backend="nccl")
        out = Path(options["--out"])
        (out / "record.json").write_text(json.dumps(build_record(cfg, rt, results)))
        if "--save-params" in args:  # check() compares the weights: the same ones, as parity promises
            torch.save({"weight": torch.zeros(1)}, out / "params.pt")
        return 0, []


def fake_cuda(mp: pytest.MonkeyPatch, gpus: int) -> None:
    """Make torch.cuda claim `gpus` H100s, as far as the package asks."""
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(torch.cuda, "device_count", lambda: gpus)
    mp.setattr(torch.cuda, "get_device_name", lambda device=None: GPU_NAME)
    mp.setattr(torch.cuda, "get_device_properties",
               lambda device=None: SimpleNamespace(name=GPU_NAME, total_memory=GPU_MEMORY_BYTES))
    mp.setattr(torch.cuda, "mem_get_info",
               lambda device=None: (GPU_MEMORY_BYTES - CUDA_CONTEXT_BYTES, GPU_MEMORY_BYTES))
    mp.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    mp.setattr(torch.version, "cuda", "12.8")
    mp.setattr(torch, "__version__", torch.torch_version.TorchVersion(torch.__version__.split("+")[0] + "+cu128"))


def _replay_on_the_cpu(*args, **kwargs):
    """Stands in for the stale-gradient replay, which trains in this process, on the CPU."""
    raise RunsOnTheCPU("the stale-gradient replay")


def _refile_on_server_cpu(experiment: str, folder: Path) -> None:
    """The committed records of an experiment that runs on the CPU, as the server's CPU files them."""
    rewritten = []
    for r in records.read_records(COMMITTED / f"{experiment}.jsonl"):
        p = r["provenance"]
        server = records.provenance(p["backend"], p["world_size"], "cpu", p["threads_per_worker"])
        rewritten.append({**r, "provenance": server})
    records.write_records(folder / records.machine_tag("cpu") / f"{experiment}.jsonl", rewritten)


def write_gpu_results(folder: Path, gpus: int) -> str:
    """Write into `folder` the results/ of a server with `gpus` H100s after `make figures`
    (see the module's docstring); return the GPU machine tag. Raises ExperimentFailed,
    after writing everything, if any run failed."""
    shutil.copytree(COMMITTED, folder / COMMITTED.name)
    workers = GpuWorkers(training_records(COMMITTED))
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, gpus)
        mp.setattr(os, "cpu_count", lambda: SERVER_CORES)
        for (module, name), function in GPU_PATH.items():
            mp.setattr(module, name, function)
        mp.setattr(records, "RESULTS_DIR", folder)
        mp.setattr(launch_module, "run_torchrun", workers)
        mp.setattr(importlib.import_module("multigpu.asynchronous"), "train_with_stale_gradients", _replay_on_the_cpu)
        tag, failed = records.machine_tag(), []
        for name in experiments.EXPERIMENTS:
            workers.experiment = name
            try:
                experiments.run_experiment(name, progress=False)
            except RunsOnTheCPU:
                assert not (folder / tag / f"{name}.jsonl").exists(), f"{name} ran partly on the GPUs"
                _refile_on_server_cpu(name, folder)
            except experiments.ExperimentFailed as err:
                failed.append(str(err))
    if failed:
        raise experiments.ExperimentFailed("\n".join(failed))
    return tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a new folder: MULTIGPU_RESULTS for the chapters")
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    print(write_gpu_results(args.folder, args.gpus))


if __name__ == "__main__":
    main()
