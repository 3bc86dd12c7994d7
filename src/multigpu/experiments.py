"""The experiments behind the book's figures: what `make figures` runs.

Most experiments are lists of training runs (RunConfigs), sized for the machine at hand:
small presets on a CPU (gloo, a few processes), GPT-2 sizes on CUDA GPUs (NCCL). Others
are lists of `Job`s, measurements that are not training runs (collective benchmarks, a
replay of stale gradients); each job returns its own records. Records go to
results/<machine-tag>/<experiment>.jsonl. The file is rewritten after every run, always
whole (write aside, then rename), so an interrupted sweep keeps the runs that finished and
never leaves a half-written line; other machines' folders are never touched.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from multigpu import records
from multigpu.comm import sent_bytes
from multigpu.config import SHARDED, RunConfig
from multigpu.launch import launch, threads_per_process
from multigpu.runtime import machine_gpus, resolve_requested


@dataclass
class Job:
    """A measurement that is not a training run: `run(**kwargs)` returns records."""

    name: str
    run: Callable[..., list[dict]]
    kwargs: dict = field(default_factory=dict)


def gpus_here() -> int:
    """The CUDA GPUs the experiments may use: the machine's, or none where MULTIGPU_DEVICE=cpu
    keeps `auto` on the CPU (runtime.resolve_requested)."""
    return 0 if resolve_requested("auto") == "cpu" else machine_gpus()


def on_gpus(count: int = 1) -> bool:
    """Whether `count` CUDA GPUs are here: the runs then use NCCL and GPT-2 sizes."""
    return gpus_here() >= count


def ddp_device() -> str:
    """Multi-process experiments run on GPUs only if there are at least 2, else on the CPU."""
    return "cuda" if on_gpus(2) else "cpu"


def max_world_size() -> int:
    """Processes the scaling sweeps go up to: every GPU (if 2 or more), or 4 CPU processes."""
    return gpus_here() if on_gpus(2) else 4


def tp_degrees(model: str, seq_len: int) -> list[int]:
    """The tensor-parallel degrees of the tp sweeps: 2, and the largest degree up to every GPU
    (up to 4 processes on a CPU) that splits the model's heads, MLP and vocabulary evenly, with
    sequence parallelism too (on 6 GPUs, gpt-small's 8 heads take 4)."""
    from multigpu.models import tensor_parallel_problems

    fits = [t for t in range(2, max_world_size() + 1) if not tensor_parallel_problems(model, t, seq_len, True)]
    return sorted({2, max(fits, default=2)})


def _one_device_memory() -> list[RunConfig]:
    """Memory of one device by optimizer, batch size and sequence length."""
    model, batch, seq = ("gpt2", 8, 256) if on_gpus() else ("gpt-small", 2, 64)
    base = RunConfig(model=model, global_batch_size=batch, seq_len=seq, steps=6, dataset="dummy")
    runs = [base.replace(optimizer=o) for o in ("sgd", "sgd-momentum", "adamw")]
    runs += [base.replace(global_batch_size=b, extra={"sweep": "batch"}) for b in (1, 2, 4, 8, 16)]
    runs += [base.replace(seq_len=s, extra={"sweep": "seq_len"}) for s in (32, 64, 128, 256)]
    return runs


def _one_device_techniques() -> list[RunConfig]:
    """What mixed precision (bf16, and fp16 with loss scaling), activation checkpointing and
    accumulation change."""
    model, batch, seq = ("gpt2", 16, 512) if on_gpus() else ("gpt-small", 8, 128)
    base = RunConfig(model=model, global_batch_size=batch, seq_len=seq, steps=10, optimizer="adamw",
                     dataset="dummy")
    return [
        base.replace(extra={"technique": "baseline"}),
        base.replace(dtype="bf16-mixed", extra={"technique": "bf16-mixed"}),
        base.replace(dtype="fp16-mixed", extra={"technique": "fp16-mixed"}),
        base.replace(activation_checkpointing=True, extra={"technique": "activation checkpointing"}),
        base.replace(grad_accum_steps=2, extra={"technique": "accumulation x2"}),
        base.replace(grad_accum_steps=4, extra={"technique": "accumulation x4"}),
    ]


def _machine_peak() -> list[RunConfig]:
    """The tracker's peak beside the machine's own (the resident set on a CPU, the caching
    allocator on a GPU) for models of real size in one process, GPT and T5 (as released,
    dropout on): what the estimator's "will it fit" is calibrated with
    (multigpu.accuracy.machine_calibration)."""
    scale = 4 if on_gpus() else 1
    runs = [RunConfig(model="gpt2", global_batch_size=b * scale, seq_len=256, steps=4, optimizer="adamw",
                      dataset="dummy") for b in (1, 2, 4)]
    runs += [RunConfig(model="t5-small", global_batch_size=b * scale, seq_len=256, steps=4,
                       optimizer="sgd-momentum", dataset="dummy") for b in (2, 4)]
    runs.append(RunConfig(model="t5-base", global_batch_size=2 * scale, seq_len=256, steps=4,
                          optimizer="sgd-momentum", dataset="dummy"))
    return runs


def _ddp_scaling() -> list[RunConfig]:
    """Step time and bytes all-reduced as processes grow, per-process batch held fixed."""
    model, per_rank, seq = ("gpt2", 8, 256) if on_gpus(2) else ("gpt-mini", 8, 128)
    runs = [RunConfig(model=model, global_batch_size=per_rank, seq_len=seq, steps=8, dataset="dummy",
                      device=ddp_device())]
    n = 1
    while n <= max_world_size():
        for strategy in ("ddp", "ddp-scratch"):
            runs.append(RunConfig(strategy=strategy, world_size=n, model=model, global_batch_size=per_rank * n,
                                  seq_len=seq, steps=8, dataset="dummy", device=ddp_device()))
        n *= 2
    return runs


def _ddp_vs_scratch() -> list[RunConfig]:
    """ddp and ddp-scratch alternated (A B A B ...) in one sweep, so both see the same noise."""
    model, batch, seq, n = ("gpt2", 16, 256, 2) if on_gpus(2) else ("gpt-small", 8, 128, 2)
    return [RunConfig(strategy=s, world_size=n, model=model, global_batch_size=batch, seq_len=seq,
                      steps=20, dataset="dummy", bucket_cap_mb=4.0, track_memory=False,
                      device=ddp_device(), extra={"repeat": r})
            for r in range(3) for s in ("ddp", "ddp-scratch")]


def _ddp_buckets() -> list[RunConfig]:
    """Bucket size: many small all-reduces against a few large ones."""
    model, batch, seq = ("gpt2", 16, 256) if on_gpus(2) else ("gpt-small", 8, 128)
    return [RunConfig(strategy="ddp-scratch", world_size=2, model=model, global_batch_size=batch, seq_len=seq,
                      steps=10, dataset="dummy", bucket_cap_mb=cap, track_memory=False, device=ddp_device())
            # 1024 MB holds any preset here in one bucket: one all-reduce after backward, no overlap
            for cap in (0.0625, 0.25, 1.0, 4.0, 25.0, 1024.0)]


def _ddp_learning() -> list[RunConfig]:
    """The learnable task: single and DDP loss curves on the same global batches."""
    model = "gpt2" if on_gpus(2) else "gpt-tiny"
    base = RunConfig(model=model, global_batch_size=16, steps=60, optimizer="adamw", lr=3e-3,
                     dataset="synthetic", track_memory=False, device=ddp_device())
    return [base, base.replace(strategy="ddp", world_size=2), base.replace(strategy="ddp-scratch", world_size=2)]


def _dp_vs_ddp() -> list[RunConfig]:
    """DataParallel against DDP: same model, same per-replica batch; dp at two batches per
    replica count, so the chapter can fit what each sample costs each replica."""
    model, per_replica, seq = ("gpt2", 4, 256) if on_gpus(2) else ("gpt-small", 4, 128)
    device = ddp_device()
    base = RunConfig(model=model, seq_len=seq, steps=8, dataset="dummy", optimizer="sgd-momentum", device=device)
    runs = [base.replace(global_batch_size=per_replica)]
    for n in sorted({2, max_world_size()}) if on_gpus(2) else (2, 4):
        runs += [base.replace(strategy="ddp", world_size=n, global_batch_size=per_replica * n),
                 base.replace(strategy="dp", world_size=n, global_batch_size=per_replica * n),
                 base.replace(strategy="dp", world_size=n, global_batch_size=2 * per_replica * n)]
    return runs


def _sharded_memory_comm() -> list[RunConfig]:
    """Every sharding strategy against DDP: memory by category, bytes sent and step time,
    same model, same per-rank batch, world sizes 2 and 4 (or 2 and every GPU)."""
    model, per_rank, seq = ("gpt2", 4, 256) if on_gpus(2) else ("gpt-small", 2, 128)
    base = RunConfig(model=model, seq_len=seq, steps=8, optimizer="adamw", lr=1e-3, dataset="dummy",
                     device=ddp_device())
    runs = [base.replace(global_batch_size=per_rank)]
    for n in sorted({2, max_world_size()}) if on_gpus(2) else (2, 4):
        for strategy in ["ddp", *SHARDED]:
            runs.append(base.replace(strategy=strategy, world_size=n, global_batch_size=per_rank * n))
        runs.append(base.replace(strategy="fsdp", world_size=n, global_batch_size=per_rank * n,
                                 extra={"reshard_after_forward": False}))
        runs.append(base.replace(strategy="fsdp", world_size=n, global_batch_size=per_rank * n,
                                 extra={"wrap": "root"}))
    return runs


def _largest_batch_records(strategy: str, world_size: int, cap_mib: int) -> list[dict]:
    from multigpu.maxbatch import measure_largest_batch

    model, seq = ("gpt2", 512) if on_gpus(2) else ("gpt-small", 128)
    cfg = RunConfig(strategy=strategy, world_size=world_size, model=model, seq_len=seq, optimizer="adamw",
                    lr=1e-3, dataset="dummy", device=ddp_device())
    found = measure_largest_batch(cfg, cap_mib * 2**20)
    if found["provenance"] is None:
        raise RuntimeError(f"largest_batch: not one {strategy} run finished under {cap_mib} MiB per rank")
    return [{"config": cfg.to_dict(), **found, "probes": {str(k): v for k, v in found["probes"].items()}}]


def _largest_batch() -> list[Job]:
    """The sources' question, "how large a batch fits?", for every strategy under one cap per
    rank (on a CPU: the tracked peak against the cap; on GPUs: the allocator and the GPU)."""
    n = max_world_size() if on_gpus(2) else 2
    cap = int(torch.cuda.get_device_properties(0).total_memory // 2**20 * 0.9) if on_gpus(2) else 256
    jobs = [Job(f"single, cap {cap} MiB", _largest_batch_records, dict(strategy="single", world_size=1, cap_mib=cap))]
    for strategy in ("ddp", "dp", "zero1", "zero2", "zero3", "fsdp", "fsdp1", "deepspeed-zero3"):
        jobs.append(Job(f"{strategy} x{n}, cap {cap} MiB", _largest_batch_records,
                        dict(strategy=strategy, world_size=n, cap_mib=cap)))
    return jobs


def _fsdp_precision() -> list[RunConfig]:
    """FSDP2 in fp32 and with a bf16 MixedPrecisionPolicy (fp32 gradient reduction),
    alternated (A B A B): memory, bytes gathered and step time."""
    model, per_rank, seq = ("gpt2", 4, 256) if on_gpus(2) else ("gpt-small", 2, 128)
    base = RunConfig(strategy="fsdp", world_size=2, model=model, global_batch_size=2 * per_rank, seq_len=seq,
                     steps=10, optimizer="adamw", lr=1e-3, dataset="dummy", device=ddp_device())
    return [base.replace(dtype=d, extra={"repeat": r}) for r in range(2) for d in ("fp32", "bf16-mixed")]


def _offload() -> list[RunConfig]:
    """DeepSpeed ZeRO-2 with and without its optimizer state offloaded to the CPU,
    alternated (A B A B) so both see the same noise."""
    model, per_rank, seq = ("gpt2", 4, 256) if on_gpus(2) else ("gpt-small", 2, 128)
    base = RunConfig(strategy="deepspeed-zero2", world_size=2, model=model, global_batch_size=2 * per_rank,
                     seq_len=seq, steps=10, optimizer="adamw", lr=1e-3, dataset="dummy", device=ddp_device())
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    return [base.replace(extra={**extra, "repeat": r}) for r in range(2) for extra in ({}, offload)]


MiB = 2**20  # bytes
# message sizes from 4 KiB to 256 MiB; the small ones share one launch
_SMALL = [4 * 1024, 16 * 1024, 64 * 1024, 256 * 1024]
_LARGE = [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]


def _collective_records(world_size: int, sizes: list[int]) -> list[dict]:
    from multigpu.collectives import ALL_REDUCES, HALVES
    from multigpu.spmd import run_spmd

    per_rank = run_spmd("multigpu.collectives:benchmark", world_size, sizes=sizes,
                        algorithms=[*ALL_REDUCES, *HALVES], timeout_s=900)
    prov = records.provenance("gloo", world_size, "cpu", threads_per_process(world_size))
    out = []
    for rows in zip(*per_rank):  # the same (size, algorithm) on every rank
        first = rows[0]
        # a call ends when its slowest rank is done
        time_s = statistics.median(max(t) for t in zip(*(r["times_s"] for r in rows)))
        algbw = first["size_bytes"] / time_s
        out.append({
            "world_size": world_size, "size_bytes": first["size_bytes"], "algorithm": first["algorithm"],
            "time_s": time_s, "calls_timed": len(first["times_s"]),
            "algbw_bytes_per_s": algbw,
            # NCCL-tests' bus bandwidth: the bytes a ring sends per rank, per second, so
            # that N = 2 and N = 8 compare (all-reduce 2(N-1)/N of the data, each half (N-1)/N)
            "busbw_bytes_per_s": sent_bytes("reduce_scatter" if first["algorithm"] in HALVES else "all_reduce",
                                            algbw, world_size),
            "sent_bytes_by_rank": [r["sent_bytes"] for r in rows],
            "loopback_bytes_per_call": first["loopback_bytes_per_call"],
            "provenance": prov,
        })
    return out


def _collectives_bandwidth() -> list[Job]:
    """Every all-reduce (and the two halves) by message size, on 2 and 4 gloo processes."""
    return [Job(f"all-reduce x{n}, {sizes[0] // 1024} KiB-{sizes[-1] // 1024} KiB" if len(sizes) > 1
                else f"all-reduce x{n}, {sizes[0] // MiB} MiB", _collective_records, dict(world_size=n, sizes=sizes))
            for n in (2, 4) for sizes in [_SMALL, *([s] for s in _LARGE)]]


def _tp_model() -> tuple[str, int, int]:
    """(model, global batch, sequence length) of the tensor-parallel experiments."""
    # not gpt2 on GPUs: its 50,257-token vocabulary does not split over 2 ranks, nor its 12 heads over 8
    return ("gpt-small", 8, 256) if on_gpus(2) else ("gpt-small", 8, 128)


# the library's collectives as benchmark() names them -> CommCounter's kinds
_LINK_COLLECTIVES = {"library": "all_reduce", "library reduce-scatter": "reduce_scatter",
                     "library all-gather": "all_gather"}


def _link_model_records(world_size: int) -> list[dict]:
    """The link as alpha + beta x bytes: each library collective timed at message sizes
    around a tensor-parallel layer's activations (16 KiB to 4 MiB), fitted per collective.

    Fitted to the mean time per call, not the median: a training step pays the sum of its
    calls, and on a shared CPU a few calls in ten wait a scheduler tick (milliseconds) for a
    peer to wake up, which the mean keeps and the median hides."""
    from multigpu.comm import fit_alpha_beta
    from multigpu.spmd import run_spmd

    sizes = [16 * 1024, 64 * 1024, 256 * 1024, MiB, 4 * MiB]
    per_rank = run_spmd("multigpu.collectives:benchmark", world_size, sizes=sizes, algorithms=list(_LINK_COLLECTIVES),
                        min_time_s=1.0, max_reps=200, timeout_s=900)
    prov = records.provenance("gloo", world_size, "cpu", threads_per_process(world_size))
    out = []
    for name, kind in _LINK_COLLECTIVES.items():
        rows = [[r for r in rank if r["algorithm"] == name] for rank in per_rank]
        # a call ends when its slowest rank is done
        calls = [[max(t) for t in zip(*(rank[i]["times_s"] for rank in rows))] for i in range(len(sizes))]
        # benchmark's size is the whole tensor: an all-gather's payload is one rank's shard of it
        payloads = [s // world_size if kind == "all_gather" else s for s in sizes]
        sent = [sent_bytes(kind, p, world_size) for p in payloads]
        mean_s = [statistics.fmean(c) for c in calls]
        out.append({"world_size": world_size, "collective": kind, "payload_bytes": payloads, "sent_bytes": sent,
                    "mean_s": mean_s, "median_s": [statistics.median(c) for c in calls],
                    "calls_timed": [len(c) for c in calls], **fit_alpha_beta(sent, mean_s), "provenance": prov})
    return out


def _link_model() -> list[Job]:
    """Alpha-beta fits of this machine's collectives on 2 and 4 processes (or every GPU)."""
    return [Job(f"alpha-beta x{n}", _link_model_records, dict(world_size=n)) for n in (2, 4)]


def _tp_width_records(tp: int) -> list[dict]:
    from multigpu.spmd import run_spmd

    rows = run_spmd("multigpu.tp_bench:mlp_step_times", tp, threads=1, widths=[128, 256, 512, 1024], tokens=1024)[0]
    prov = records.provenance("gloo" if tp > 1 else "none", tp, "cpu", 1)
    return [{**row, "provenance": prov} for row in rows]


def _tp_width() -> list[Job]:
    """One Megatron MLP at four widths, on 1 process and on tp 2, one thread each: where the
    compute saved outweighs the collectives added."""
    return [Job(f"MLP widths, tp {tp}", _tp_width_records, dict(tp=tp)) for tp in (1, 2)]


def _tp_collectives_records(strategy: str, world_size: int, sequence_parallel: bool) -> list[dict]:
    from multigpu.spmd import run_spmd

    model, batch, seq = _tp_model()
    trace = run_spmd("multigpu.traces:tp_collectives", world_size, strategy=strategy, model_name=model,
                     batch=batch, seq_len=seq, sequence_parallel=sequence_parallel)[0]
    return [{**trace, "provenance": records.provenance("gloo", world_size, "cpu", threads_per_process(world_size))}]


def _tp_collectives() -> list[Job]:
    """Every collective of one tensor-parallel step, forward and backward, counted and on
    the wire: both implementations, with and without sequence parallelism, tp 2 and 4."""
    return [Job(f"{s} tp {n}{' +SP' if sp else ''}", _tp_collectives_records,
                dict(strategy=s, world_size=n, sequence_parallel=sp))
            for n in (2, 4) for s in ("tp-scratch", "tp") for sp in (False, True)]


def _tp_scaling() -> list[RunConfig]:
    """Memory by category and step time as tp grows, from scratch and the library's
    alternated (A B A B) so both see the same noise; with and without sequence parallelism."""
    model, batch, seq = _tp_model()
    # one thread per process, as one GPU per rank: tp 2 has twice the cores of one device
    # (tp 4 on a 2-core CPU shares them: it shows the communication, not a speed-up)
    base = RunConfig(model=model, global_batch_size=batch, seq_len=seq, steps=8, optimizer="adamw", lr=1e-3,
                     dataset="dummy", device=ddp_device(), threads_per_worker=None if on_gpus(2) else 1)
    runs = [base]
    for repeat in range(2):
        for tp in tp_degrees(model, seq):  # (on 2 GPUs, once)
            for sp in (False, True):
                for strategy in ("tp-scratch", "tp"):
                    runs.append(base.replace(strategy=strategy, world_size=tp,
                                             extra={"sequence_parallel": sp, "repeat": repeat}))
    return runs


def _pp_bubble_records(implementation: str, schedule: str, stages: int, ms: list[int]) -> list[dict]:
    from multigpu.spmd import run_spmd

    rows = run_spmd(f"multigpu.pp_bubble:{implementation}_bubble", stages, schedule=schedule, ms=ms, timeout_s=900)
    prov = records.provenance("gloo", stages, "cpu", threads_per_process(stages))
    # one record per (schedule, m): every rank's events, the slowest rank's step
    return [{**{k: v for k, v in by_rank[0].items() if k not in ("events", "step_start_unix")},
             "events_by_rank": [r["events"] for r in by_rank], "step_start_unix_by_rank":
             [r["step_start_unix"] for r in by_rank], "provenance": prov} for by_rank in zip(*rows)]


def _pp_bubble() -> list[Job]:
    """The bubble of every schedule on stages that sleep instead of computing (no core is
    shared, whatever the machine): p = 2 and 4 stages, m = 1 to 16 micro-batches."""
    jobs = []
    for p in (2, 4):
        for schedule in ("pp-naive", "pp-gpipe-scratch", "pp-1f1b-scratch"):
            jobs.append(Job(f"{schedule} p={p}", _pp_bubble_records,
                            dict(implementation="scratch", schedule=schedule, stages=p, ms=[1, 2, 4, 8, 16])))
        for schedule in ("pp-gpipe", "pp-1f1b", "pp-interleaved", "pp-zbv"):
            needs = 2 * p if schedule in ("pp-interleaved", "pp-zbv") else p if schedule == "pp-1f1b" else 1
            jobs.append(Job(f"{schedule} p={p}", _pp_bubble_records,
                            dict(implementation="library", schedule=schedule, stages=p,
                                 ms=[m for m in (1, 2, 4, 8, 16) if m >= needs])))
    return jobs


def _pp_schedules() -> list[RunConfig]:
    """The real model on 2 stages (one per core), every schedule, m = 4, twice, alternated:
    timelines from the event logs, step times, bytes between the stages."""
    model, batch, seq = ("gpt2", 8, 256) if on_gpus(2) else ("gpt-small", 8, 128)
    base = RunConfig(world_size=2, model=model, global_batch_size=batch, seq_len=seq, grad_accum_steps=4, steps=8,
                     optimizer="adamw", lr=1e-3, dataset="dummy", device=ddp_device(), threads_per_worker=1)
    names = ["pp-naive", "pp-gpipe-scratch", "pp-gpipe", "pp-1f1b-scratch", "pp-1f1b", "pp-interleaved", "pp-zbv"]
    return [base.replace(strategy=name, extra={"repeat": r}) for r in range(2) for name in names]


def _pp_memory() -> list[RunConfig]:
    """Activations in flight: GPipe and 1F1B on 2 stages as the micro-batches grow (each
    micro-batch 2 samples, so the batch grows with them)."""
    model, seq = ("gpt2", 256) if on_gpus(2) else ("gpt-small", 128)
    base = RunConfig(world_size=2, model=model, seq_len=seq, steps=3, optimizer="sgd", dataset="dummy",
                     device=ddp_device(), threads_per_worker=1)
    return [base.replace(strategy=name, grad_accum_steps=m, global_batch_size=2 * m)
            for name in ("pp-gpipe-scratch", "pp-1f1b-scratch") for m in (1, 2, 4, 8)]


# Compositions on one grid (chapter "Putting it together"): name -> (strategy, processes,
# RunConfig fields). The rank grid each makes is dp x pp x tp (config.RunConfig.degrees).
COMPOSITIONS = {
    "FSDP x TP (2D)": ("fsdp", 4, dict(tp=2)),
    "DDP x TP from scratch (2D)": ("ddp-scratch", 4, dict(tp=2)),
    "HSDP: 2 replicas x 2 shards": ("fsdp", 4, dict(extra={"replicas": 2})),
    "PP x TP": ("pp-1f1b", 4, dict(tp=2)),
    "PP x FSDP": ("pp-1f1b", 4, dict(dp=2)),
    "PP x FSDP x TP (3D)": ("pp-1f1b", 8, dict(tp=2, dp=2)),
}


def _composition_records(name: str) -> list[dict]:
    """One composition: its parity with one device (`check`, 3 steps), then a run of the
    same grid with memory and communication measured."""
    from multigpu.check import check

    strategy, processes, fields = ("single", 1, {}) if name == "single" else COMPOSITIONS[name]
    device = "cuda" if on_gpus(8) else "cpu"  # one device for every composition, up to 8 processes
    model = "gpt-small" if device == "cuda" else "gpt-mini"
    base = dict(model=model, global_batch_size=8, grad_accum_steps=4 if strategy.startswith("pp-") else 1,
                device=device, **fields)
    cfg = RunConfig(strategy=strategy, world_size=processes, steps=6, optimizer="adamw", lr=1e-3,
                    dataset="dummy", **base).validate()
    record = launch(cfg, progress=False)
    record["composition"] = name
    if name != "single":
        record["parity"] = check(strategy, processes, steps=3, progress=False, **base)
    return [record]


def _compositions() -> list[Job]:
    """Every composition of the chapter, and the single device they are compared with."""
    return [Job(name, _composition_records, dict(name=name)) for name in ["single", *COMPOSITIONS]]


def _staleness_records(delay: int) -> list[dict]:
    from multigpu.asynchronous import train_with_stale_gradients

    record = train_with_stale_gradients(delay, steps=300, lr=0.1)
    record["provenance"] = records.provenance("none", 1, "cpu", torch.get_num_threads())
    return [record]


def _async_staleness() -> list[Job]:
    """Synchronous SGD (delay 0) against gradients 1-8 updates stale, as an asynchronous
    parameter server applies them; one process, the learnable task."""
    return [Job(f"delay {d}", _staleness_records, dict(delay=d)) for d in (0, 1, 2, 4, 8)]


EXPERIMENTS = {
    "one_device_memory": _one_device_memory,
    "one_device_techniques": _one_device_techniques,
    "machine_peak": _machine_peak,
    "ddp_scaling": _ddp_scaling,
    "ddp_vs_scratch": _ddp_vs_scratch,
    "ddp_buckets": _ddp_buckets,
    "ddp_learning": _ddp_learning,
    "dp_vs_ddp": _dp_vs_ddp,
    "sharded_memory_comm": _sharded_memory_comm,
    "largest_batch": _largest_batch,
    "offload": _offload,
    "fsdp_precision": _fsdp_precision,
    "collectives_bandwidth": _collectives_bandwidth,
    "async_staleness": _async_staleness,
    "link_model": _link_model,
    "tp_collectives": _tp_collectives,
    "tp_width": _tp_width,
    "tp_scaling": _tp_scaling,
    "pp_bubble": _pp_bubble,
    "pp_schedules": _pp_schedules,
    "pp_memory": _pp_memory,
    "compositions": _compositions,
}


def _identity(record: dict) -> str:
    """What a record is a measurement of: its job, or its run's config."""
    return f"job {record['job']}" if "job" in record else json.dumps(record.get("config"), sort_keys=True)


class ExperimentFailed(RuntimeError):
    """Some runs of an experiment failed; the others' records (and the old ones) are kept."""


def run_experiment(name: str, *, progress: bool | None = None) -> list[dict]:
    """Run every item of experiment `name`; return the new records.

    Records are never lost: after every item the file is rewritten (whole, aside, then
    renamed) with the records made so far, beside the records from before that no new one
    replaces, so an interrupt or a crash keeps both. When every item has run, the file holds
    exactly the new records. An item that fails is reported and skipped (its old records
    stay); the experiment then raises ExperimentFailed after the others have run."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from: {', '.join(EXPERIMENTS)}")
    done: list[dict] = []
    failed: list[str] = []
    old: dict[str, list[dict]] = {}
    path = None
    items = EXPERIMENTS[name]()
    for i, item in enumerate(items, start=1):
        start = time.monotonic()
        what = item.name if isinstance(item, Job) else f"{item.strategy} x{item.world_size} {item.model}"
        try:
            if isinstance(item, Job):
                new = item.run(**item.kwargs)
                for record in new:
                    record["job"] = item.name
            else:
                new = [launch(item, progress=progress)]
                what += f": {new[0]['step_time_s'] * 1e3:.1f} ms/step"
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # noqa: BLE001 - reported, and the other items still run
            failed.append(f"{what}: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
            print(f"  [{name} {i}/{len(items)}] FAILED {failed[-1]}", flush=True)
            continue
        for record in new:
            record["experiment"] = name
        done += new
        tags = {r["provenance"]["machine_tag"] for r in done}
        if len(tags) > 1:
            raise RuntimeError(f"experiment {name} mixed devices ({', '.join(sorted(tags))}); "
                               "give its configs one device")
        if path is None:  # the records from before, by what they measure
            path = records.results_path(name, tags.pop())
            for record in records.read_records(path) if path.exists() else []:
                old.setdefault(_identity(record), []).append(record)
        replaced = {_identity(r) for r in done}
        kept = [] if i == len(items) and not failed else [
            r for key, rs in old.items() if key not in replaced for r in rs]
        records.write_records(path, kept + done)  # after every run: an interrupt keeps everything
        print(f"  [{name} {i}/{len(items)}] {what} ({time.monotonic() - start:.0f} s)", flush=True)
    if failed:
        if path is not None:  # the last item failed: the file still has the old records of every failure
            replaced = {_identity(r) for r in done}
            records.write_records(path, [r for key, rs in old.items() if key not in replaced for r in rs] + done)
        raise ExperimentFailed(f"{name}: {len(failed)} of {len(items)} run(s) failed: " + "; ".join(failed))
    return done


def check_results_dir(path) -> None:
    """Before the first run: the results folder (MULTIGPU_RESULTS, default results/) must be a
    folder this process can write, or become one; else say so, not after an hour of runs."""
    from pathlib import Path

    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"the results folder {path} cannot be made: {existing} is a file; point MULTIGPU_RESULTS "
                         "at a folder (or unset it for results/)")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"the results folder {path} cannot be written ({existing} is not writable); point "
                         "MULTIGPU_RESULTS at a folder you can write")


def run_experiments(names: list[str] | None = None) -> None:
    names = names or list(EXPERIMENTS)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {', '.join(map(repr, unknown))}; choose from: "
                         f"{', '.join(EXPERIMENTS)}")
    check_results_dir(records.RESULTS_DIR)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if on_gpus() else []
    print(f"multigpu figures: {len(names)} experiment(s) on {records.machine_tag()}: {records.cpu_name()}, "
          f"{os.cpu_count()} cores, {len(gpus)} CUDA GPU(s){' (' + ', '.join(gpus) + ')' if gpus else ''}; "
          f"torch {torch.__version__}; writing to {records.RESULTS_DIR}/<machine>/ (from {records.RESULTS_FROM})",
          flush=True)
    start = time.monotonic()
    failures = []
    for name in names:
        try:
            run_experiment(name, progress=False)
        except KeyboardInterrupt:
            print(f"multigpu figures: interrupted during {name}; the runs that finished are kept in "
                  f"{records.RESULTS_DIR}/<machine>/{name}.jsonl, beside the records from before",
                  file=sys.stderr, flush=True)
            raise
        except ExperimentFailed as err:
            failures.append(str(err))
    print(f"multigpu figures: done in {time.monotonic() - start:.0f} s; {len(names) - len(failures)} of "
          f"{len(names)} experiment(s) recorded whole", file=sys.stderr, flush=True)
    if failures:
        raise ExperimentFailed("some runs failed (their old records are kept):\n" + "\n".join(failures))
