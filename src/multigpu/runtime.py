"""Inside a worker: who am I, on which device, talking over which backend.

torchrun starts every worker with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in its environment; `init_process_group` reads them ("env://").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int  # index of this process among all processes (all nodes)
    local_rank: int  # index among the processes of this machine (node)
    world_size: int  # number of processes in the job
    device: torch.device
    backend: str  # "nccl" (CUDA GPUs) or "gloo" (CPU)

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
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return Runtime(rank, local_rank, world_size, device, backend)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
