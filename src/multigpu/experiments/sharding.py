"""The experiments of chapters "ZeRO" and "FSDP": every sharding strategy against DDP, the
largest batch each fits, and what precision and offloading change."""

from __future__ import annotations

import torch

from multigpu.config import SHARDED, RunConfig
from multigpu.experiments.machine import Job, ddp_device, max_world_size, on_gpus


def sharded_memory_comm() -> list[RunConfig]:
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
    return [{"config": cfg.to_dict(), "grid": cfg.grid.as_dict(), **found,
             "probes": {str(k): v for k, v in found["probes"].items()}}]


def largest_batch() -> list[Job]:
    """The sources' question, "how large a batch fits?", for every strategy under one cap per
    rank (on a CPU: the tracked peak against the cap; on GPUs: the allocator and the GPU)."""
    n = max_world_size() if on_gpus(2) else 2
    cap = int(torch.cuda.get_device_properties(0).total_memory // 2**20 * 0.9) if on_gpus(2) else 256
    jobs = [Job(f"single, cap {cap} MiB", _largest_batch_records, dict(strategy="single", world_size=1, cap_mib=cap))]
    for strategy in ("ddp", "dp", "zero1", "zero2", "zero3", "fsdp", "fsdp1", "deepspeed-zero3"):
        jobs.append(Job(f"{strategy} x{n}, cap {cap} MiB", _largest_batch_records,
                        dict(strategy=strategy, world_size=n, cap_mib=cap)))
    return jobs


def fsdp_precision() -> list[RunConfig]:
    """FSDP2 in fp32 and with a bf16 MixedPrecisionPolicy (fp32 gradient reduction),
    alternated (A B A B): memory, bytes gathered and step time."""
    model, per_rank, seq = ("gpt2", 4, 256) if on_gpus(2) else ("gpt-small", 2, 128)
    base = RunConfig(strategy="fsdp", world_size=2, model=model, global_batch_size=2 * per_rank, seq_len=seq,
                     steps=10, optimizer="adamw", lr=1e-3, dataset="dummy", device=ddp_device())
    return [base.replace(dtype=d, extra={"repeat": r}) for r in range(2) for d in ("fp32", "bf16-mixed")]


def offload() -> list[RunConfig]:
    """DeepSpeed ZeRO-2 with and without its optimizer state offloaded to the CPU,
    alternated (A B A B) so both see the same noise."""
    model, per_rank, seq = ("gpt2", 4, 256) if on_gpus(2) else ("gpt-small", 2, 128)
    base = RunConfig(strategy="deepspeed-zero2", world_size=2, model=model, global_batch_size=2 * per_rank,
                     seq_len=seq, steps=10, optimizer="adamw", lr=1e-3, dataset="dummy", device=ddp_device())
    to_cpu = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    return [base.replace(extra={**extra, "repeat": r}) for r in range(2) for extra in ({}, to_cpu)]
