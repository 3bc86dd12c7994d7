"""Inside a worker: who am I, on which device, talking over which backend.

torchrun starts every worker with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in its environment; `init_process_group` reads them ("env://").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# The grid's dimensions, outermost first (torchtitan's order). Tensor parallelism is the
# innermost: its ranks are consecutive, which on a GPU server means the GPUs of one node,
# joined by the fastest links, because TP talks in every layer. Pipeline stages are the
# outermost: they exchange only activations between neighbours, the least traffic.
GRID_DIMS = ("pp", "dp", "tp")


@dataclass
class RankGrid:
    """The processes as a pp x dp x tp grid (picotron's process-group manager, torchtitan's
    ParallelDims). Rank r sits at (pp, dp, tp) = divmod-wise coordinates of r with tp fastest:
    ranks r and r+1 differ in their tp coordinate. `mesh` is the same grid as a named
    `DeviceMesh` (what PyTorch's FSDP2, tensor parallel and pipelining take); `group(dim)`
    the plain process group of this rank's line along `dim` (what the from-scratch
    strategies pass to every collective)."""

    sizes: dict[str, int]  # {"pp": ..., "dp": ..., "tp": ...}
    rank: int
    device_type: str = "cpu"
    _mesh: object = None
    _groups: dict = field(default_factory=dict)

    @classmethod
    def build(cls, device_type: str, dp: int = 1, pp: int = 1, tp: int = 1) -> RankGrid:
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        world = dist.get_world_size() if dist.is_initialized() else 1
        if pp * dp * tp != world:
            raise ValueError(f"world size {world} != dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp}")
        return cls(sizes, dist.get_rank() if dist.is_initialized() else 0, device_type)

    @property
    def mesh(self):
        """The grid as a DeviceMesh with dimensions named pp, dp, tp (`mesh["tp"]` is this
        rank's TP line). Made on first use, by every rank at the same point of the program
        (creating its groups is a collective call); a plain data-parallel run never needs it."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device_type, tuple(self.sizes[d] for d in GRID_DIMS),
                                          mesh_dim_names=GRID_DIMS)
        return self._mesh

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coord(self, dim: str) -> int:
        """This rank's index along `dim` (its data-parallel rank, its stage, its TP rank)."""
        index = GRID_DIMS.index(dim)
        inner = 1
        for d in GRID_DIMS[index + 1:]:
            inner *= self.sizes[d]
        return (self.rank // inner) % self.sizes[dim]

    def group(self, dim: str):
        """The process group of the ranks that share every coordinate but `dim` with this one.
        A dimension that spans the whole world is the default group itself."""
        if self.sizes[dim] == dist.get_world_size():
            return dist.group.WORLD
        if dim not in self._groups:
            self._groups[dim] = self.mesh.get_group(dim)
        return self._groups[dim]


@dataclass
class Runtime:
    rank: int  # index of this process among all processes (all nodes)
    local_rank: int  # index among the processes of this machine (node)
    world_size: int  # number of processes in the job
    device: torch.device
    backend: str  # "nccl" (CUDA GPUs) or "gloo" (CPU)
    grid: RankGrid | None = None  # the pp x dp x tp grid, built once the run's degrees are known

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_device(requested: str, world_size: int) -> tuple[str, str, str]:
    """('cuda', 'nccl', why) when the machine has a GPU for every worker, else CPU and gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < world_size:
        raise ValueError(
            f"device='cuda' needs {world_size} CUDA GPU(s), this machine has {gpus}; "
            "use device='cpu' or 'auto', or fewer processes"
        )
    if requested != "cpu" and gpus >= world_size:
        return "cuda", "nccl", f"NCCL on {world_size} of {gpus} CUDA GPU(s)"
    why = "as asked" if requested == "cpu" else f"this machine has {gpus} CUDA GPU(s) for {world_size} worker(s)"
    return "cpu", "gloo", f"gloo on CPU ({why})"


def init(device_type: str, timeout_s: float = 300) -> Runtime:
    """Join the process group torchrun set up; pin this process to its GPU if any."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # device_id binds NCCL to this GPU now: start-up errors surface here, and barriers know
    # their device (without it rank 0 warns "using the device under current context")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device_type == "cuda" else None)
    return Runtime(rank, local_rank, world_size, device, backend)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
