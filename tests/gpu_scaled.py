"""How a GPU run's record is scaled from a committed CPU record of the same setting: what
`train.train` returns on each rank of a GPU server (tests/gpu_shaped.py writes the records
from it). Numbers are plausible, not predicted: the rules are in `gpu_train_result`."""

from __future__ import annotations

import copy
import functools
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fake_cuda.sitecustomize import GPUS as FAKE_GPUS
from fake_cuda.sitecustomize import cublas_workspace_size
from multigpu import records
from multigpu.comm import sent_bytes
from multigpu.config import ZERO_STAGE, RunConfig
from multigpu.memory import CATEGORIES
from multigpu.models import GPT_SIZES, default_seq_len, parameter_count
from multigpu.strategies.dp import GPUDataParallel

H100, A100, V100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"
GPU_NAME = H100

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
