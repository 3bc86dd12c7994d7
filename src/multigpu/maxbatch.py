"""The largest batch that fits: found by measurement, run by run.

Under a memory cap per rank, which per-rank batch is the largest whose measured peak fits?
Every probe is a real (short) training run. On CUDA the peak is the allocator's; on a CPU,
where nothing stops a process at a cap, it is the peak PyTorch's memory tracker saw,
compared with the cap. Memory grows linearly with the batch, so two probes predict the
answer and a few more confirm it: the largest batch that fits, and the next that does not.
"""

from __future__ import annotations

from multigpu.config import RunConfig
from multigpu.launch import LaunchError, launch


def peak_bytes(record: dict) -> int:
    """The highest per-rank peak of a run: the CUDA allocator's where there is one."""
    cuda = [b for b in record["cuda_allocator_peak_bytes_by_rank"] if b is not None]
    return max(cuda) if cuda else max(m["total"] for m in record["peak_memory_bytes_by_rank"])


def probe_config(cfg: RunConfig, per_rank: int) -> RunConfig:
    """The run that probes a per-rank batch: two steps, no accumulation, memory tracked."""
    return cfg.replace(global_batch_size=per_rank * cfg.world_size, grad_accum_steps=1, steps=2, track_memory=True)


def measure_largest_batch(cfg: RunConfig, cap_bytes: int, limit: int = 1024, progress: bool | None = False) -> dict:
    """Measured (the runs train; estimate.predict_largest_batch predicts it without running):
    the largest per-rank batch (micro-batches of it, no accumulation) whose peak fits
    `cap_bytes`; returns it with every probe (per-rank batch -> peak bytes, None for a run
    that ran out of memory) and the provenance of the last run that finished."""
    n = cfg.world_size  # the batch splits over processes, or over dp's replicas
    probes: dict[int, int | None] = {}
    provenance = {}

    def fits(per_rank: int) -> bool:
        if per_rank not in probes:
            run = probe_config(cfg, per_rank)
            try:
                record = launch(run, progress=progress)
                probes[per_rank], provenance["last"] = peak_bytes(record), record["provenance"]
            except LaunchError as err:  # a run the device cannot hold at all does not fit either
                if "out of memory" not in str(err).lower():
                    raise
                probes[per_rank] = None
        return probes[per_rank] is not None and probes[per_rank] <= cap_bytes

    def result(best: int) -> dict:
        return {"per_rank_batch": best, "global_batch": best * n, "probes": probes, "cap_bytes": cap_bytes,
                "provenance": provenance.get("last")}

    if not fits(1):
        return result(0)

    def crossing(x0: int, x1: int) -> int:
        """Where the line through the probes at x0 and x1 reaches the cap; halfway when x1
        ran out of memory (no peak to draw a line through)."""
        if probes[x1] is None:
            return (x0 + x1) // 2
        slope = max((probes[x1] - probes[x0]) / (x1 - x0), 1.0)
        return int(x0 + (cap_bytes - probes[x0]) // slope)

    lo, hi, candidate = 1, None, 2  # lo fits; hi (once found) does not
    while hi is None or hi - lo > 1:
        if fits(candidate):
            previous, lo = lo, candidate
            if lo >= limit:
                break
            # not yet above the cap: follow the line through the last two that fit, but
            # never more than 4x the last fit (a flat start must not launch a huge batch)
            step = crossing(previous, lo) if hi is None else crossing(lo, hi)
            candidate = min(limit, 4 * lo, max(lo + 1, step))
        else:
            hi = candidate
            candidate = crossing(lo, hi)  # between the last fit and the first miss
        if hi is not None:
            candidate = min(max(candidate, lo + 1), hi - 1)
            if hi - lo <= 1:
                break
    return result(lo)
