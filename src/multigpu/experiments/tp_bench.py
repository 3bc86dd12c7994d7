"""Where tensor parallelism pays: one Megatron MLP (h -> 4h -> h), timed at several widths.

Per token, the MLP's matrix multiplications cost 16 h^2 FLOPs forward (two of 8 h^2), its
communication 2 all-reduces of h numbers (g forward, f backward). Compute grows as h^2 and
communication as h, so a wide layer hides its collectives and a narrow one does not. Run
under `multigpu.spmd.run_spmd("multigpu.experiments.tp_bench:mlp_step_times", tp, threads=1)`:
on 1 process the plain MLP, on tp processes the column- then row-parallel one; one thread
per process, as one GPU per rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from multigpu.comm import CommCounter
from multigpu.strategies.tp_scratch import ColumnParallelLinear, RowParallelLinear


def megatron_mlp(width: int, group=None) -> nn.Module:
    """The MLP of a transformer block, cut over `group` (None or one rank: whole)."""
    torch.manual_seed(0)
    fc, proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
    if group is None or dist.get_world_size(group) == 1:
        return nn.Sequential(fc, nn.GELU(), proj)
    return nn.Sequential(ColumnParallelLinear(fc, group), nn.GELU(), RowParallelLinear(proj, group))


def mlp_step_times(widths: list[int], tokens: int = 1024, reps: int = 5) -> list[dict]:
    """Per width: the seconds of each forward+backward (after a warm-up; the slowest rank's),
    and the collectives of one of them as CommCounter logs them."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    rows = []
    for width in widths:
        mlp = megatron_mlp(width, dist.group.WORLD if tp > 1 else None)
        x = torch.randn(1, tokens, width, requires_grad=True)
        grad = torch.randn(1, tokens, width)
        times, log = [], []
        for rep in range(reps + 1):
            if tp > 1:
                dist.barrier()
            start = time.perf_counter()
            with CommCounter(tp) as comm:
                mlp(x).backward(grad)
            took = torch.tensor([time.perf_counter() - start])
            if tp > 1:
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
            if rep:  # rep 0 warms up (allocations, gloo's first buffers)
                times.append(took.item())
            log = comm.log
        rows.append({"width": width, "tokens": tokens, "tp": tp, "step_s": statistics.median(times),
                     "times_s": times, "flops": 3 * 16 * tokens * width**2, "comm_log": log})
    return rows
