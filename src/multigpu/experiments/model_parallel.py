"""The experiments of chapters "Tensor parallelism" and "Pipeline parallelism": where a split
layer pays, the collectives of a tensor-parallel step, memory and time as tp grows, and the
pipeline schedules' bubble, timelines and activations in flight."""

from __future__ import annotations

from multigpu import records
from multigpu.config import RunConfig
from multigpu.experiments.machine import Job, ddp_device, on_gpus, tp_degrees
from multigpu.launch import threads_per_process


def tp_model() -> tuple[str, int, int]:
    """(model, global batch, sequence length) of the tensor-parallel experiments."""
    # not gpt2 on GPUs: its 50,257-token vocabulary does not split over 2 ranks, nor its 12 heads over 8
    return ("gpt-small", 8, 256) if on_gpus(2) else ("gpt-small", 8, 128)


def _tp_width_records(tp: int) -> list[dict]:
    from multigpu.spmd import run_spmd

    rows = run_spmd("multigpu.experiments.tp_bench:mlp_step_times", tp, threads=1, widths=[128, 256, 512, 1024],
                    tokens=1024)[0]
    prov = records.provenance("gloo" if tp > 1 else "none", tp, "cpu", 1)
    return [{**row, "provenance": prov} for row in rows]


def tp_width() -> list[Job]:
    """One Megatron MLP at four widths, on 1 process and on tp 2, one thread each: where the
    compute saved outweighs the collectives added."""
    return [Job(f"MLP widths, tp {tp}", _tp_width_records, dict(tp=tp)) for tp in (1, 2)]


def _tp_collectives_records(strategy: str, world_size: int, sequence_parallel: bool) -> list[dict]:
    from multigpu.spmd import run_spmd

    model, batch, seq = tp_model()
    trace = run_spmd("multigpu.experiments.step_traces:tp_collectives", world_size, strategy=strategy,
                     model_name=model, batch=batch, seq_len=seq, sequence_parallel=sequence_parallel)[0]
    return [{**trace, "provenance": records.provenance("gloo", world_size, "cpu", threads_per_process(world_size))}]


def tp_collectives() -> list[Job]:
    """Every collective of one tensor-parallel step, forward and backward, counted and on
    the wire: both implementations, with and without sequence parallelism, tp 2 and 4."""
    return [Job(f"{s} tp {n}{' +SP' if sp else ''}", _tp_collectives_records,
                dict(strategy=s, world_size=n, sequence_parallel=sp))
            for n in (2, 4) for s in ("tp-scratch", "tp") for sp in (False, True)]


def tp_scaling() -> list[RunConfig]:
    """Memory by category and step time as tp grows, from scratch and the library's
    alternated (A B A B) so both see the same noise; with and without sequence parallelism."""
    model, batch, seq = tp_model()
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

    rows = run_spmd(f"multigpu.experiments.pp_bubble:{implementation}_bubble", stages, schedule=schedule, ms=ms,
                    timeout_s=900)
    prov = records.provenance("gloo", stages, "cpu", threads_per_process(stages))
    # one record per (schedule, m): every rank's events, the slowest rank's step
    return [{**{k: v for k, v in by_rank[0].items() if k not in ("events", "step_start_unix")},
             "events_by_rank": [r["events"] for r in by_rank], "step_start_unix_by_rank":
             [r["step_start_unix"] for r in by_rank], "provenance": prov} for by_rank in zip(*rows)]


def pp_bubble() -> list[Job]:
    """The bubble of every schedule on stages that sleep instead of computing (no core is
    shared, whatever the machine): p = 2 and 4 stages, m = 1 to 16 micro-batches."""
    jobs = []
    for p in (2, 4):
        for schedule in ("pp-naive", "pp-gpipe-scratch", "pp-1f1b-scratch"):
            jobs.append(Job(f"{schedule} p={p}", _pp_bubble_records,
                            dict(implementation="scratch", schedule=schedule, stages=p, ms=[1, 2, 4, 8, 16])))
        for schedule in ("pp-gpipe", "pp-1f1b", "pp-interleaved", "pp-zbv", "pp-dualpipev"):
            needs = 2 * p if schedule in ("pp-interleaved", "pp-zbv", "pp-dualpipev") else \
                p if schedule == "pp-1f1b" else 1
            jobs.append(Job(f"{schedule} p={p}", _pp_bubble_records,
                            dict(implementation="library", schedule=schedule, stages=p,
                                 ms=[m for m in (1, 2, 4, 8, 16) if m >= needs])))
    return jobs


def pp_schedules() -> list[RunConfig]:
    """The real model on 2 stages (one per core), every schedule, m = 4, twice, alternated:
    timelines from the event logs, step times, bytes between the stages."""
    model, batch, seq = ("gpt2", 8, 256) if on_gpus(2) else ("gpt-small", 8, 128)
    base = RunConfig(world_size=2, model=model, global_batch_size=batch, seq_len=seq, grad_accum_steps=4, steps=8,
                     optimizer="adamw", lr=1e-3, dataset="dummy", device=ddp_device(), threads_per_worker=1)
    names = ["pp-naive", "pp-gpipe-scratch", "pp-gpipe", "pp-1f1b-scratch", "pp-1f1b", "pp-interleaved", "pp-zbv"]
    return [base.replace(strategy=name, extra={"repeat": r}) for r in range(2) for name in names]


def pp_memory() -> list[RunConfig]:
    """Activations in flight: GPipe and 1F1B on 2 stages as the micro-batches grow (each
    micro-batch 2 samples, so the batch grows with them)."""
    model, seq = ("gpt2", 256) if on_gpus(2) else ("gpt-small", 128)
    base = RunConfig(world_size=2, model=model, seq_len=seq, steps=3, optimizer="sgd", dataset="dummy",
                     device=ddp_device(), threads_per_worker=1)
    return [base.replace(strategy=name, grad_accum_steps=m, global_batch_size=2 * m)
            for name in ("pp-gpipe-scratch", "pp-1f1b-scratch") for m in (1, 2, 4, 8)]

