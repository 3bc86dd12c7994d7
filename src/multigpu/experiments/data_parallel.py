"""The experiments of chapters "DataParallel" and "DDP": replicas of the whole model, their
step time, bytes all-reduced, buckets and loss curves."""

from __future__ import annotations

from multigpu.config import RunConfig
from multigpu.experiments.machine import ddp_device, max_world_size, on_gpus


def ddp_scaling() -> list[RunConfig]:
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


def ddp_vs_scratch() -> list[RunConfig]:
    """ddp and ddp-scratch alternated (A B A B ...) in one sweep, so both see the same noise."""
    model, batch, seq, n = ("gpt2", 16, 256, 2) if on_gpus(2) else ("gpt-small", 8, 128, 2)
    return [RunConfig(strategy=s, world_size=n, model=model, global_batch_size=batch, seq_len=seq,
                      steps=20, dataset="dummy", bucket_cap_mb=4.0, track_memory=False,
                      device=ddp_device(), extra={"repeat": r})
            for r in range(3) for s in ("ddp", "ddp-scratch")]


def ddp_buckets() -> list[RunConfig]:
    """Bucket size: many small all-reduces against a few large ones."""
    model, batch, seq = ("gpt2", 16, 256) if on_gpus(2) else ("gpt-small", 8, 128)
    return [RunConfig(strategy="ddp-scratch", world_size=2, model=model, global_batch_size=batch, seq_len=seq,
                      steps=10, dataset="dummy", bucket_cap_mb=cap, track_memory=False, device=ddp_device())
            # 1024 MB holds any preset here in one bucket: one all-reduce after backward, no overlap
            for cap in (0.0625, 0.25, 1.0, 4.0, 25.0, 1024.0)]


def ddp_learning() -> list[RunConfig]:
    """The learnable task: single and DDP loss curves on the same global batches."""
    model = "gpt2" if on_gpus(2) else "gpt-tiny"
    base = RunConfig(model=model, global_batch_size=16, steps=60, optimizer="adamw", lr=3e-3,
                     dataset="synthetic", track_memory=False, device=ddp_device())
    return [base, base.replace(strategy="ddp", world_size=2), base.replace(strategy="ddp-scratch", world_size=2)]


def dp_vs_ddp() -> list[RunConfig]:
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
