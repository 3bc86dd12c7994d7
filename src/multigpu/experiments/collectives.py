"""The experiments of chapter "Collectives": every all-reduce by message size, the link as
alpha + beta x bytes (which the tensor-parallel chapter and "Choosing" price steps with), and
the stale gradients of an asynchronous parameter server. Each measures on gloo processes
started by `run_spmd`, or in this process: on the CPU, whatever the machine."""

from __future__ import annotations

import statistics

import torch

from multigpu import records
from multigpu.comm import sent_bytes
from multigpu.experiments.machine import Job
from multigpu.launch import threads_per_process

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


def collectives_bandwidth() -> list[Job]:
    """Every all-reduce (and the two halves) by message size, on 2 and 4 gloo processes."""
    return [Job(f"all-reduce x{n}, {sizes[0] // 1024} KiB-{sizes[-1] // 1024} KiB" if len(sizes) > 1
                else f"all-reduce x{n}, {sizes[0] // MiB} MiB", _collective_records, dict(world_size=n, sizes=sizes))
            for n in (2, 4) for sizes in [_SMALL, *([s] for s in _LARGE)]]


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


def link_model() -> list[Job]:
    """Alpha-beta fits of this machine's collectives on 2 and 4 processes (or every GPU)."""
    return [Job(f"alpha-beta x{n}", _link_model_records, dict(world_size=n)) for n in (2, 4)]


def _staleness_records(delay: int) -> list[dict]:
    from multigpu.asynchronous import train_with_stale_gradients

    record = train_with_stale_gradients(delay, steps=300, lr=0.1)
    record["provenance"] = records.provenance("none", 1, "cpu", torch.get_num_threads())
    return [record]


def async_staleness() -> list[Job]:
    """Synchronous SGD (delay 0) against gradients 1-8 updates stale, as an asynchronous
    parameter server applies them; one process, the learnable task."""
    return [Job(f"delay {d}", _staleness_records, dict(delay=d)) for d in (0, 1, 2, 4, 8)]

