"""The estimator against the records: for every recorded run it models, the estimate of the
same setup beside what the run measured, by category (the chapter "Choosing a strategy" and
tests/test_estimate.py read it)."""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.config import RunConfig
from multigpu.estimator.model_trace import model_shape
from multigpu.estimator.peak import Estimate, estimate, saved_activations
from multigpu.estimator.question import PIPELINES, Setup, cublas_workspace_bytes
from multigpu.memory import CATEGORIES
from multigpu.recompute import recompute_mode
from multigpu.strategy_table import STRATEGY_TABLE


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


# what an estimate is held against: the memory tracker counts tensors (a record's
# peak_memory_bytes_by_rank), the CUDA caching allocator also what cuBLAS allocates raw from it
AGAINST = ("allocator", "tracker")


def setup_of(record: dict, against: str = "allocator") -> Setup | None:
    """The estimator's question for a recorded run (or a run about to start: its config and
    provenance), or None for a strategy it does not model (also: ddp-scratch with tp, HSDP's
    replicas, FSDP wrapping anything but blocks).

    `against`: what the estimate will be held against. "allocator" (the default: what a GPU
    must hold, as `fits.memory_problem` and the machine's calibration ask) counts cuBLAS's
    workspaces on a GPU; "tracker" (a record's categories, `against_records`) leaves them
    out, since MemTracker never sees them. Both keep the allocator's 512-byte rounding, which
    MemTracker applies on CUDA too. On a CPU the two are the same question."""
    if against not in AGAINST:
        raise ValueError(f"against must be one of {AGAINST}, got {against!r}")
    from multigpu.models import default_seq_len

    c = record["config"]
    extra = c["extra"]
    # the estimator's strategy for the recorded one (the strategy table's `estimated_as`: the
    # from-scratch and library versions of one idea are estimated as one; None: not modelled)
    row = STRATEGY_TABLE.get(c["strategy"])
    strategy = row.estimated_as if row else None
    if strategy is None or extra.get("wrap", "blocks") != "blocks" or extra.get("replicas"):
        return None
    # the grid the run stated (a record written before records did: its config's, by the same rule)
    grid = record.get("grid") or RunConfig.from_dict(c).grid.as_dict()
    if grid["tp"] > 1 and c["strategy"] == "ddp-scratch":
        return None
    if strategy in PIPELINES:  # fewer micro-batches than the library's schedule takes
        from multigpu.strategies.pp import microbatch_problem

        if microbatch_problem(strategy, c["grad_accum_steps"], grid["pp"]):
            return None
    prov = record["provenance"]
    on_cuda, workspaces = prov["device_type"] == "cuda", 0
    if on_cuda and against == "allocator":
        # the workspace size torch reported on the run's GPU, or else its compute capability, where
        # the record kept them (records.provenance, on CUDA); else (records written before, a run
        # about to start) cublas_workspace_bytes's rule by the GPU's name
        capability = prov.get("compute_capability")
        workspaces = cublas_workspace_bytes(prov["device_names"][0], tuple(capability) if capability else None,
                                            prov.get("cublas_workspace_size_bytes"))
    return Setup(model=c["model"], strategy=strategy, world_size=c["world_size"],
                 seq_len=c["seq_len"] or default_seq_len(c["model"]), dtype=c["dtype"], optimizer=c["optimizer"],
                 activation_checkpointing=c["activation_checkpointing"], grad_accum_steps=c["grad_accum_steps"],
                 reshard_after_forward=extra.get("reshard_after_forward", True),
                 bucket_cap_mb=c["bucket_cap_mb"], backend=prov["backend"], on_cuda=on_cuda,
                 cuda_workspace_bytes=workspaces,
                 tp=grid["tp"], pp=grid["pp"], cp=grid.get("cp", 1), ep=grid.get("ep", 1),
                 cp_attention=extra.get("cp_attention", "ring"),  # the layout (cp_balance) keeps the same bytes
                 sequence_parallel=bool(extra.get("sequence_parallel")),
                 attention=extra.get("attention", "sdpa"))  # a T5 run may compute attention eagerly


# how close an estimate must come to a record: a category within 10% of itself or 5% of the peak,
# whichever is larger (a few MiB move between categories with the allocator's timing); a fresh
# run's total within 5% (tests/test_estimate.py); the machine's peak, calibrated, within 15%
# (tests/test_calibration.py)
CATEGORY_TOLERANCE, PEAK_SHARE_TOLERANCE = 0.10, 0.05
TOTAL_TOLERANCE = 0.05
MACHINE_TOLERANCE = 0.15


def categories_off(row: dict) -> list[str]:
    """The categories of an `against_records` row whose estimate is off by more than
    CATEGORY_TOLERANCE of the measured category and more than PEAK_SHARE_TOLERANCE of the
    measured peak."""
    meas = row["measured"]

    def off(est):
        return [c for c in CATEGORIES
                if abs(est[c] - meas[c]) > max(CATEGORY_TOLERANCE * meas[c], PEAK_SHARE_TOLERANCE * meas["total"])]

    # where moments tie at the peak, the tracker files it as whichever came first: either may agree
    return min((off(est) for est in (row["estimated"], *row.get("tied", ()))), key=len)


def against_records(records: list[dict]) -> list[dict]:
    """One row per recorded run the estimator models: estimated and measured bytes by
    category (rank 0, the DP primary; under a pipeline the rank whose estimated peak is the
    highest), and the relative error of the total."""
    rows = []
    for r in records:
        setup = setup_of(r, against="tracker")
        peak = (r.get("peak_memory_bytes_by_rank") or [None])[0] or {}
        if setup is None or not peak.get("total") or any(peak.get(c) is None for c in CATEGORIES):
            # a strategy the estimator does not model, a run that did not track memory, or
            # one whose categories the GPU path leaves unmeasured (dp on GPUs: the allocator's total only)
            continue
        found = estimate(setup, r["config"]["global_batch_size"])
        est, meas = found.per_rank_bytes, measured_categories(r, found.pipeline_rank or 0)
        d = setup.grid.as_dict()
        grid = ", ".join(f"{k} {d[k]}" for k in ("tp", "pp") if d[k] > 1)
        recompute = recompute_mode(setup.activation_checkpointing)
        variant = ", ".join(v for v in ("no reshard" if not setup.reshard_after_forward else "",
                                        "SP" if setup.sequence_parallel else "",
                                        f"m {setup.grad_accum_steps}" if setup.strategy in PIPELINES else "",
                                        f"{recompute} recompute" if recompute else "") if v)
        rows.append({"experiment": r.get("experiment"), "strategy": r["config"]["strategy"],
                     "variant": variant, "grid": grid, "rank": found.pipeline_rank or 0,
                     "world_size": r["config"]["world_size"], "global_batch": r["config"]["global_batch_size"],
                     "estimated": est, "measured": meas, "total_error": est["total"] / meas["total"] - 1,
                     "phase": found.phase, "tied": found.tied})
    return rows


# -- the machine's peak: what the estimate leaves out, calibrated on records -------------------

CALIBRATED_BY = "machine_peak"  # the experiment whose runs calibrate it (multigpu.experiments)


@dataclass(frozen=True)
class Calibration:
    """What a kind of device really holds at a step's peak against what the estimator counts
    (live tensors, as the package's tracker): on a CPU the resident set (glibc's malloc keeps
    freed memory, kernels' temporaries the tracker never sees), on a GPU the caching
    allocator's allocated peak (its rounding, cuBLAS's workspaces; `machine_peak`). What the machine holds beyond the
    estimate is fitted by least squares, as a part per byte of saved activations (backward
    makes a gradient of each, and the memory it frees stays with the allocator) and a fixed
    part, to the runs of `CALIBRATED_BY` recorded on that kind of device, of the model's family
    where it has two runs or more (measured on a CPU: T5's attention, computed in pieces, leaves
    much more behind than GPT's fused kernel)."""

    device: str  # "cpu" or "cuda"
    family: str | None  # the models' family the runs are of ("gpt", "t5"), None: every family
    per_activation: float  # bytes beyond the estimate per byte of saved activations
    fixed: float  # and bytes beyond it whatever the batch
    runs: int
    source: str  # the machines and the experiment the runs come from
    worst_miss: float  # the fit's largest |fitted - measured| / measured over its runs

    def machine_bytes(self, result: Estimate) -> int:
        """The machine's peak for an estimate."""
        return round(result.per_rank_bytes["total"] + self.per_activation * saved_activations(result) + self.fixed)

    def describe(self) -> str:
        return (f"+ {self.per_activation:.2f} x the saved activations {'-' if self.fixed < 0 else '+'} "
                f"{abs(self.fixed) / 2**20:,.0f} MiB, fitted to "
                f"{self.runs} {self.family.upper() + ' ' if self.family else ''}runs of {self.source} "
                f"(worst miss {self.worst_miss:.1%})")


def machine_peak(record: dict, rank: int = 0) -> int | None:
    """A record's peak as its machine counted it, above the process's size before the model was
    built; None if unknown. On a CPU the resident set. On a GPU the caching allocator's
    allocated peak, not what it reserved: a reserve grows freely while the GPU has room, and
    under a cap the allocator frees its cached blocks before it gives up (T5-large's largest
    batch under 32 GiB, results/1xH200-nccl: the batch whose allocated peak was 31.25 GiB
    trained), so what must fit is what was allocated."""
    peaks = record.get("process_peak_by_rank") or [None]
    peak = peaks[rank] if rank < len(peaks) else None
    if not peak or peak.get("peak_bytes") is None:
        return None
    return peak["peak_bytes"]


def machine_rows(device: str) -> list[dict]:
    """Every run of `CALIBRATED_BY` on a `device` ("cpu" or "cuda") machine: the estimate (of
    the tensors, and the activations saved) beside the tracker's peak and the machine's."""
    from multigpu import records

    rows = []
    for tag in records.machines_with(CALIBRATED_BY):
        for record in records.load(CALIBRATED_BY, tag):
            setup, measured = setup_of(record, against="allocator"), machine_peak(record)
            if setup is None or measured is None or setup.on_cuda != (device == "cuda"):
                continue
            c = record["config"]
            est = estimate(setup, c["global_batch_size"])
            rows.append({"machine": tag, "model": c["model"], "family": model_shape(c["model"]).family,
                         "dtype": c["dtype"], "batch": c["global_batch_size"], "seq_len": setup.seq_len,
                         # on a GPU also what the allocator reserved (the calibration does not use it)
                         "reserved": (record["process_peak_by_rank"][0] or {}).get("reserved_bytes"),
                         "estimated": est.per_rank_bytes["total"], "saved activations": saved_activations(est),
                         "tracker": record["peak_memory_bytes_by_rank"][0]["total"], "machine_peak": measured,
                         "estimate": est})
    return rows


def machine_calibration(device: str, family: str | None = None) -> Calibration | None:
    """How far the machine's peak on `device` exceeds the estimate, from the records of
    `family`'s runs where there are two or more, else of every run; None where fewer than two
    runs were recorded on such a machine."""
    rows = machine_rows(device)
    if len([r for r in rows if r["family"] == family]) >= 2:
        rows = [r for r in rows if r["family"] == family]
    else:
        family = None
    if len(rows) < 2:
        return None
    xs, ys = [r["saved activations"] for r in rows], [r["machine_peak"] - r["estimated"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    per_activation = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0
    fixed = my - per_activation * mx
    fitted = Calibration(device, family, per_activation, fixed, len(rows), "", 0.0)
    worst = max(abs(fitted.machine_bytes(r["estimate"]) - r["machine_peak"]) / r["machine_peak"] for r in rows)
    tags = sorted({r["machine"] for r in rows})
    return Calibration(device, family, per_activation, fixed, len(rows), f"{CALIBRATED_BY} on {', '.join(tags)}",
                       worst)


# -- the step-time model against the recorded steps ---------------------------------------------

def step_time_rows(records: list[dict], tag: str) -> list[dict]:
    """The step-time model (`step_time.step_time`) against every step of `records` (of machine `tag`) it models:
    one row per run of 1, 2 or 4 processes with one thread each on a CPU (as one GPU per rank: the rate the model
    assumes, `recorded_machine`'s) or any GPU run, with the model's two bounds (nothing hidden, everything hidden)
    beside the measured step and the first bound's error."""
    import dataclasses

    from multigpu.errors import ConfigError
    from multigpu.estimator.step_time import recorded_machine, step_time

    machines: dict = {}
    rows = []
    for r in records:
        c, prov = r.get("config"), r.get("provenance", {})
        if not c or not r.get("step_time_s") or c["strategy"] == "dp":
            continue
        if prov.get("device_type") != "cuda" and prov.get("threads_per_worker") != 1:
            continue  # a process on several threads computes faster than the one-thread rate the model takes
        setup = setup_of(r, against="tracker")
        if setup is None:
            continue
        n = c["world_size"]
        if n not in machines:
            try:
                machines[n] = recorded_machine(n, tag) if n > 1 else dataclasses.replace(recorded_machine(2, tag),
                                                                                         gpus_per_node=1)
            except (ConfigError, FileNotFoundError, StopIteration):  # no link fitted for n processes, or no rate
                machines[n] = None
        if machines[n] is None:
            continue
        try:
            bounds = [step_time(setup, c["global_batch_size"], machines[n], overlap=o).total_s for o in (False, True)]
        except ConfigError:
            continue
        rows.append({"experiment": r.get("experiment"), "strategy": c["strategy"], "world_size": n,
                     "model": c["model"], "measured_s": r["step_time_s"], "nothing_hidden_s": bounds[0],
                     "all_hidden_s": bounds[1], "error": bounds[0] / r["step_time_s"] - 1})
    return rows
