"""What every experiment sizes itself by: the GPUs here, the processes a sweep goes up to, and
`Job`, the item of an experiment that is a measurement rather than a training run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from multigpu.runtime import machine_gpus, resolve_requested


@dataclass
class Job:
    """A measurement that is not a training run: `run(**kwargs)` returns records."""

    name: str
    run: Callable[..., list[dict]]
    kwargs: dict = field(default_factory=dict)


def gpus_here() -> int:
    """The CUDA GPUs the experiments may use: the machine's, or none where MULTIGPU_DEVICE=cpu
    keeps `auto` on the CPU (runtime.resolve_requested)."""
    return 0 if resolve_requested("auto") == "cpu" else machine_gpus()


def on_gpus(count: int = 1) -> bool:
    """Whether `count` CUDA GPUs are here: the runs then use NCCL and GPT-2 sizes."""
    return gpus_here() >= count


def ddp_device() -> str:
    """Multi-process experiments run on GPUs only if there are at least 2, else on the CPU."""
    return "cuda" if on_gpus(2) else "cpu"


def max_world_size() -> int:
    """Processes the scaling sweeps go up to: every GPU (if 2 or more), or 4 CPU processes."""
    return gpus_here() if on_gpus(2) else 4


def tp_degrees(model: str, seq_len: int) -> list[int]:
    """The tensor-parallel degrees of the tp sweeps: 2, and the largest degree up to every GPU
    (up to 4 processes on a CPU) that splits the model's heads, MLP and vocabulary evenly, with
    sequence parallelism too (on 6 GPUs, gpt-small's 8 heads take 4)."""
    from multigpu.models import tensor_parallel_problems

    fits = [t for t in range(2, max_world_size() + 1) if not tensor_parallel_problems(model, t, seq_len, True)]
    return sorted({2, max(fits, default=2)})
