"""Where one training step's time goes, from PyTorch's own profiler: a run whose config asks for it
(`extra["profile"]`: True, or a folder for the traces) runs its last step, untimed, under
`torch.profiler`, and its record gets that step's time by category (`breakdown`), when each rank
computed and communicated (`timeline`) and, with a folder (a relative one under the machine's
results folder), each rank's trace for Perfetto or chrome://tracing.

The categories, from each operator's own time (its children's not counted twice): the matrix
products, attention's fused kernels, the collectives (with what waits for them, and FSDP's copies
into and out of its gathers and reductions), the optimizer's step (every operator under it), every
other operator, and the time outside any operator (on a CPU: Python, the framework, waiting; a
pipeline's bubble is there).
On a GPU the operators' time is their kernels' on the device (each kernel counted once, under the
operator that launched it: the profiler lists the kernels themselves too, and the labelled ranges'
copies on the device), and the time outside any operator is when the device ran no kernel. An NCCL
kernel runs from when its stream reaches it until its peers arrive, so there "communication"
includes waiting for peers (a pipeline's bubble is in its receive kernels), and kernels on
different streams overlap, so the categories can add up to more than the step. The time a rank
computed nothing (`idle`, from the timeline) is the bubble on both. On a CPU the operators' time is
the threads', which for an autograd thread beside the main one can add up to more than the wall
clock.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = ("matmul", "attention", "communication", "optimizer", "other operators", "outside operators")
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv", "aten::addmv",
            "aten::dot", "aten::_grouped_mm"}
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_COMMUNICATION = ("c10d::", "_c10d_functional::", "gloo:", "nccl", "Nccl", "record_param_comms", "ProcessGroup")
_SHARDING = ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait")


def category(name: str, under: str | None) -> str:
    """The category of an operator (or a labelled range) called `name`, inside the labelled range `under` (the
    optimizer's step, a sharded model's gather or reduction, or None)."""
    if name in _MATMULS:
        return "matmul"
    if any(part in name for part in _ATTENTION):
        return "attention"
    if name.startswith(_COMMUNICATION) or under == "communication":
        return "communication"
    return "optimizer" if under == "optimizer" else "other operators"


def _under(event) -> str | None:
    """What labelled range an event runs in: the optimizer's step, or a sharded model's gathering and reducing
    (FSDP's ranges: their copies in and out are the collectives' cost too)."""
    while event is not None:
        if event.name.startswith("Optimizer.step"):
            return "optimizer"
        if event.name.startswith(_SHARDING):
            return "communication"
        event = event.cpu_parent
    return None


def breakdown(prof, device_type: str, wall_s: float, top: int = 8) -> dict:
    """Seconds of the profiled step by category (CATEGORIES), the step's wall time ("step"), and the `top`
    operators of each category by their own seconds ("largest": {category: {operator: seconds}})."""
    from torch.autograd import DeviceType

    seconds = dict.fromkeys(CATEGORIES, 0.0)
    by_operator: dict = {}
    kernels = []
    for event in prof.events():
        if device_type == "cuda" and (event.device_type != DeviceType.CPU or event.is_user_annotation):
            if event.device_type != DeviceType.CPU and not event.is_user_annotation:
                kernels.append((event.time_range.start / 1e6, event.time_range.end / 1e6))
            continue  # a kernel (or a labelled range's copy on the device): its operator counts its time already
        own = event.self_device_time_total if device_type == "cuda" else event.self_cpu_time_total
        if own > 0:
            kind = category(event.name, _under(event))
            seconds[kind] += own / 1e6
            ops = by_operator.setdefault(kind, {})
            ops[event.name] = ops.get(event.name, 0.0) + own / 1e6
    if device_type == "cuda":  # when no kernel ran (overlapping streams' kernels counted once)
        seconds["outside operators"] = max(0.0, wall_s - sum(b - a for a, b in merged(kernels)))
    else:
        seconds["outside operators"] = max(0.0, wall_s - sum(seconds.values()))
    largest = {kind: dict(sorted(ops.items(), key=lambda item: -item[1])[:top]) for kind, ops in by_operator.items()}
    return {**seconds, "step": wall_s, "largest": largest}


def merged(intervals: list[tuple[float, float]], gap: float = 0.0) -> list[list[float]]:
    """The union of [start, end) intervals, those less than `gap` apart joined, in order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def without(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """The merged intervals `a` less the merged intervals `b`."""
    out = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append([start, cut_start])
            start = max(start, cut_end)
            if start >= end:
                break
        if start < end:
            out.append([start, end])
    return out


def overlap(a: list[list[float]], b: list[list[float]]) -> float:
    """The length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _is_collective(name: str) -> bool:
    """A collective as its backend runs it: gloo's ranges, NCCL's kernels."""
    return name.startswith("gloo:") or "nccl" in name.lower()


def _outermost_operator(event) -> bool:
    """Whether an event is an ATen operator that no other ATen operator called: one piece of the step's own work
    (the Python and the framework between two such pieces is not)."""
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _in_collective(event) -> bool:
    """Whether an operator runs inside a collective (a backend's copies into and out of its buffers)."""
    event = event.cpu_parent
    while event is not None:
        if _is_collective(event.name):
            return True
        event = event.cpu_parent
    return False


def timeline(prof, device_type: str, wall_s: float) -> dict:
    """When this rank computed and when it communicated in the profiled step, as merged [start, end) intervals in
    seconds from the step's first event (gaps under a thousandth of the step joined), and the share of the
    communicating time during which it also computed ("hidden"). On a GPU: the kernels, the collectives' (NCCL's)
    apart. On a CPU: the ATen operators no other one called (the work itself, not the Python around it), and the
    collectives as the backend runs them (gloo's own threads, or the caller's for a blocking send)."""
    from torch.autograd import DeviceType

    compute, comm, waits = [], [], []
    events = list(prof.events())
    launchers = {e.id: e for e in events if e.device_type == DeviceType.CPU  # the operators (a kernel links to one)
                 and not getattr(e, "linked_correlation_id", 0)} if device_type == "cuda" else {}
    for e in events:
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        on_device = e.device_type == DeviceType.CUDA
        if device_type == "cuda" and on_device and not e.is_user_annotation:  # kernels, not labelled ranges
            launcher = launchers.get(getattr(e, "linked_correlation_id", 0))
            if _is_collective(e.name):
                comm.append(span)
            elif e.name.startswith(("Memcpy", "Memset")):
                continue
            elif launcher is None or category(launcher.name, _under(launcher)) != "communication":
                compute.append(span)  # not a collective's copies (FSDP's into its gathers): as on a CPU
        elif device_type != "cuda" and not on_device:
            if _is_collective(e.name):
                comm.append(span)
            elif category(e.name, None) == "communication":
                waits.append(span)  # a wait inside an operator (DTensor's, for a collective's result) is not work
            elif _outermost_operator(e) and category(e.name, _under(e)) != "communication" and not _in_collective(e):
                compute.append(span)
    origin = min((start for start, _ in compute + comm), default=0.0)
    gap = wall_s / 1000
    rows = {name: merged([(a - origin, b - origin) for a, b in spans], gap)
            for name, spans in (("compute", compute), ("communication", comm), ("waits", waits))}
    rows["compute"] = without(rows["compute"], rows.pop("waits"))
    busy = sum(b - a for a, b in rows["communication"])
    return {**rows, "hidden": overlap(rows["compute"], rows["communication"]) / busy if busy else None}


def idle(profile: dict) -> float:
    """The seconds of a profiled step (a record's profile: "seconds" and "timeline") in which the rank computed
    nothing: the step less its compute spans. A pipeline's bubble, on a GPU too, where NCCL's receive kernel spins
    through it and the breakdown files it under communication."""
    return max(0.0, profile["seconds"]["step"] - sum(b - a for a, b in profile["timeline"]["compute"]))


class StepProfiler:
    """`with StepProfiler(device, rank, folder) as p:` around one step; then `p.result(wall_s)`: the breakdown,
    and where the rank's trace went (a gzipped Chrome trace in `folder`, None without one)."""

    def __init__(self, device: torch.device, rank: int, folder: str | None):
        self.device, self.rank, self.folder = device, rank, folder
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=activities)

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        return False

    def result(self, wall_s: float) -> dict:
        trace = None
        if self.folder:
            from multigpu import records

            folder = Path(self.folder).expanduser()
            if not folder.is_absolute():  # beside the machine's records: results/<machine>/<folder>
                folder = records.RESULTS_DIR / records.machine_tag(self.device.type) / folder
            folder.mkdir(parents=True, exist_ok=True)
            raw = folder / f"rank{self.rank}.json"
            self.prof.export_chrome_trace(str(raw))
            trace = str(raw) + ".gz"
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
            if Path(trace).is_relative_to(records.RESULTS_DIR):  # a record names its trace as results/ holds it
                trace = str(Path(trace).relative_to(records.RESULTS_DIR))
        return {"seconds": breakdown(self.prof, self.device.type, wall_s),
                "timeline": timeline(self.prof, self.device.type, wall_s), "trace": trace}


def check_option(value) -> None:
    """extra["profile"]: True (the breakdown only) or a folder for the traces (a relative one under the machine's
    results folder, results/<machine>/<folder>)."""
    from multigpu.errors import ConfigError

    if value is not None and value is not True and value is not False and not (isinstance(value, str) and value):
        raise ConfigError(f"profile must be true (the step's time by category) or a folder to write each rank's "
                          f"trace to, got {value!r}")
