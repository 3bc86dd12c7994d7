"""Where one training step's time goes, from PyTorch's own profiler: a run whose config asks for it
(`extra["profile"]`: True, or a folder for the traces) runs one step more, after the timed ones,
under `torch.profiler`, and its record gets that step's time by category (`breakdown`) and, with a
folder, each rank's trace for Perfetto or chrome://tracing.

The categories, from each operator's own time (its children's not counted twice): the matrix
products, attention's fused kernels, the collectives (with what waits for them, and FSDP's copies
into and out of its gathers and reductions), the optimizer's step (every operator under it), every
other operator, and the time outside any operator (Python, the framework, waiting: a pipeline's
bubble is there).
On a GPU the operators' time is their kernels' on the device; on a CPU the threads' time, which
for an autograd thread beside the main one can add up to more than the wall clock.
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
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    by_operator: dict = {}
    for event in prof.events():
        own = event.self_device_time_total if device_type == "cuda" else event.self_cpu_time_total
        if own > 0:
            kind = category(event.name, _under(event))
            seconds[kind] += own / 1e6
            ops = by_operator.setdefault(kind, {})
            ops[event.name] = ops.get(event.name, 0.0) + own / 1e6
    seconds["outside operators"] = max(0.0, wall_s - sum(seconds.values()))
    largest = {kind: dict(sorted(ops.items(), key=lambda item: -item[1])[:top]) for kind, ops in by_operator.items()}
    return {**seconds, "step": wall_s, "largest": largest}


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
            folder = Path(self.folder).expanduser()
            folder.mkdir(parents=True, exist_ok=True)
            raw = folder / f"rank{self.rank}.json"
            self.prof.export_chrome_trace(str(raw))
            trace = str(raw) + ".gz"
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
        return {"seconds": breakdown(self.prof, self.device.type, wall_s), "trace": trace}


def check_option(value) -> None:
    """extra["profile"]: True (the breakdown only) or a folder for the traces."""
    from multigpu.errors import ConfigError

    if value is not None and value is not True and value is not False and not (isinstance(value, str) and value):
        raise ConfigError(f"profile must be true (the step's time by category) or a folder to write each rank's "
                          f"trace to, got {value!r}")
