"""The estimator against the records: for every recorded run it models, the estimate of the
same setup beside what the run measured, by category (the chapter "Choosing a strategy" and
tests/test_estimate.py read it)."""

from __future__ import annotations

from multigpu.estimate import PIPELINES, Setup, cublas_workspace_bytes, degrees, estimate
from multigpu.memory import CATEGORIES

# a recorded strategy -> the estimator's (the from-scratch and library versions of one idea)
_AS_ESTIMATED = {"single": "single", "dp": "dp", "ddp": "ddp", "ddp-scratch": "ddp", "zero1": "zero1",
                 "zero2": "zero2", "zero3": "zero3", "fsdp": "fsdp",  # FSDP1's flat parameters: not modelled
                 "tp": "tp", "tp-scratch": "tp", "pp-gpipe": "pp-gpipe", "pp-gpipe-scratch": "pp-gpipe",
                 "pp-1f1b": "pp-1f1b", "pp-1f1b-scratch": "pp-1f1b", "pp-interleaved": "pp-interleaved"}


def measured_categories(record: dict, rank: int = 0) -> dict[str, int]:
    """A record's peak on `rank`, by category. Parameters, gradients and optimizer state as
    the tracker classified them; activations are the saved activations, or fewer if some
    were already freed at the peak (the tracker also files buffers that forward creates,
    such as DDP's buckets, under activations); other is the rest of the peak."""
    peak = record["peak_memory_bytes_by_rank"][rank]
    out = {k: peak[k] for k in ("params", "grads", "optimizer")}
    saved = record["saved_activation_bytes_by_rank"][rank]
    if record["config"]["strategy"].startswith("pp-"):  # one micro-batch's; several are alive at the peak
        saved = peak["activations"]
    out["activations"] = min(saved, peak["activations"])
    out["other"] = peak["total"] - sum(out.values())
    out["total"] = peak["total"]
    return out


def setup_of(record: dict) -> Setup | None:
    """The estimator's question for a recorded run, or None for a strategy it does not model
    (also: ddp-scratch with tp, HSDP's replicas, FSDP wrapping anything but blocks)."""
    from multigpu.config import RunConfig
    from multigpu.models import default_seq_len

    c = record["config"]
    extra = c["extra"]
    if c["strategy"] not in _AS_ESTIMATED or extra.get("wrap", "blocks") != "blocks" or extra.get("replicas"):
        return None
    grid = RunConfig(strategy=c["strategy"], world_size=c["world_size"], tp=c.get("tp", 1), pp=c.get("pp", 1),
                     dp=c.get("dp")).degrees
    if grid["tp"] > 1 and c["strategy"] == "ddp-scratch":
        return None
    if _AS_ESTIMATED[c["strategy"]] in PIPELINES:  # fewer micro-batches than the library's schedule takes
        from multigpu.strategies.pp import microbatch_problem

        if microbatch_problem(_AS_ESTIMATED[c["strategy"]], c["grad_accum_steps"], grid["pp"]):
            return None
    return Setup(model=c["model"], strategy=_AS_ESTIMATED[c["strategy"]], world_size=c["world_size"],
                 seq_len=c["seq_len"] or default_seq_len(c["model"]), dtype=c["dtype"], optimizer=c["optimizer"],
                 activation_checkpointing=c["activation_checkpointing"], grad_accum_steps=c["grad_accum_steps"],
                 reshard_after_forward=extra.get("reshard_after_forward", True),
                 bucket_cap_mb=c["bucket_cap_mb"], backend=record["provenance"]["backend"],
                 on_cuda=record["provenance"]["device_type"] == "cuda",
                 cuda_workspace_bytes=cublas_workspace_bytes(record["provenance"]["device_names"][0])
                 if record["provenance"]["device_type"] == "cuda" else 0,
                 tp=grid["tp"], pp=grid["pp"], sequence_parallel=bool(extra.get("sequence_parallel")))


def categories_off(row: dict) -> list[str]:
    """The categories of an `against_records` row whose estimate is off by more than 10% of
    the measured category and more than 5% of the measured peak (a few MiB move between
    categories with the allocator's timing)."""
    est, meas = row["estimated"], row["measured"]
    return [c for c in CATEGORIES if abs(est[c] - meas[c]) > max(0.10 * meas[c], 0.05 * meas["total"])]


def against_records(records: list[dict]) -> list[dict]:
    """One row per recorded run the estimator models: estimated and measured bytes by
    category (rank 0, the DP primary; under a pipeline the rank whose estimated peak is the
    highest), and the relative error of the total."""
    rows = []
    for r in records:
        setup = setup_of(r)
        peak = (r.get("peak_memory_bytes_by_rank") or [None])[0] or {}
        if setup is None or not peak.get("total") or any(peak.get(c) is None for c in CATEGORIES):
            # a strategy the estimator does not model, a run that did not track memory, or
            # one whose categories the GPU path leaves unmeasured (dp on GPUs: the allocator's total only)
            continue
        found = estimate(setup, r["config"]["global_batch_size"])
        est, meas = found.per_rank_bytes, measured_categories(r, found.pipeline_rank or 0)
        d = degrees(setup)
        grid = ", ".join(f"{k} {d[k]}" for k in ("tp", "pp") if d[k] > 1)
        variant = ", ".join(v for v in ("no reshard" if not setup.reshard_after_forward else "",
                                        "SP" if setup.sequence_parallel else "",
                                        f"m {setup.grad_accum_steps}" if setup.strategy in PIPELINES else "") if v)
        rows.append({"experiment": r.get("experiment"), "strategy": r["config"]["strategy"],
                     "variant": variant, "grid": grid, "rank": found.pipeline_rank or 0,
                     "world_size": r["config"]["world_size"], "global_batch": r["config"]["global_batch_size"],
                     "estimated": est, "measured": meas, "total_error": est["total"] / meas["total"] - 1,
                     "phase": found.phase})
    return rows
