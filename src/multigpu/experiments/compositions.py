"""The experiment of chapter "Putting it together": the parallelisms composed on one rank grid,
each checked against one device and measured."""

from __future__ import annotations

from multigpu.config import RunConfig
from multigpu.experiments.machine import Job, on_gpus
from multigpu.launch import launch

# Compositions on one grid: name -> (strategy, processes, RunConfig fields). The rank grid
# each makes is pp x dp x cp x tp (config.RunConfig.degrees).
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


def compositions() -> list[Job]:
    """Every composition of the chapter, and the single device they are compared with."""
    return [Job(name, _composition_records, dict(name=name)) for name in ["single", *COMPOSITIONS]]



def _matrix_records() -> list[dict]:
    """The parity matrix (multigpu.matrix): each cell a record, on this machine's CPU processes."""
    from multigpu import matrix, records

    device = "cuda" if on_gpus(matrix.MAX_PROCESSES) else "cpu"  # one device for every cell, as the compositions
    rows = matrix.run(device=device)
    prov = records.provenance("nccl" if device == "cuda" else "gloo", matrix.MAX_PROCESSES, device, 1)
    return [{"cell": row, "provenance": prov} for row in rows]


def parity_matrix() -> list[Job]:
    """Every composition of dp, tp, pp and cp at degree 2 in 8 processes, dense and MoE, against one device."""
    return [Job("matrix", _matrix_records)]
