"""A pipeline stage that waits instead of computing: the bubble, measured on any machine.

On a CPU with fewer cores than stages, compute-bound stages share cores, and a stage that
"waits" for its predecessor is in fact computing someone else's work: the bubble cannot be
seen. A stage whose forward and backward *sleep* a fixed time uses no CPU at all, so four
such stages on two cores behave like four devices, and the measured idle time is the
schedule's own.

`SleepStage` takes the GPT's calling convention (`input_ids=` on the first stage, `hidden=`
on the others, `labels=` on the last, which returns a loss), so the pipeline strategies run
it unchanged. Forward sleeps `forward_s`; backward sleeps `forward_s` on the input path (B:
the gradient the previous stage waits for) and `forward_s` more on the weight path (W: what
zero-bubble schedules defer), as two separate autograd nodes: backward = 2 x forward, the
usual rule for a transformer layer.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Wait(torch.autograd.Function):
    """Identity that sleeps `forward_s` in forward and `backward_s` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad.clone(), None, None


class SleepStage(nn.Module):
    """y = wait(x) * wait(w): forward sleeps `forward_s` (on the input path), backward sleeps
    `forward_s` on the input path (B) and `forward_s` on the weight path (W)."""

    def __init__(self, forward_s: float, first: bool, last: bool, width: int = 8):
        super().__init__()
        self.forward_s, self.first, self.last, self.width = forward_s, first, last, width
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, input_ids=None, labels=None, hidden=None):
        if self.first:  # token ids -> a float stream that can carry a gradient
            hidden = input_ids.float().unsqueeze(-1).expand(*input_ids.shape, self.width).contiguous()
            hidden.requires_grad_()  # so the first stage also pays its B (a real model's does not: see the chapter)
        x = _Wait.apply(hidden, self.forward_s, self.forward_s)  # F on the input path; B in backward
        w = _Wait.apply(self.weight, 0.0, self.forward_s)  # W in backward
        out = x * w
        if self.last and labels is not None:
            return out.mean()
        return out


# -- the bubble, measured: run under run_spmd("multigpu.experiments.pp_bubble:<fn>", p) ------


def _stage(first: bool, last: bool, forward_s: float):
    from types import SimpleNamespace

    stage = SleepStage(forward_s, first, last)
    stage.cfg = SimpleNamespace(d_model=stage.width)  # what the from-scratch pipeline reads its shapes from
    return stage


def _micro_batches(m: int, micro: int = 1, seq: int = 4, width: int = 8) -> list[dict]:
    ids = torch.randint(width, (m * micro, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids.split(micro)]


def _timed(run) -> tuple[float, float]:
    """(seconds of `run()` on the slowest rank, this rank's start on the wall clock)."""
    import torch.distributed as dist

    dist.barrier()
    start_unix, start = time.time(), time.perf_counter()
    run()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item(), start_unix


def scratch_bubble(schedule: str, ms: list[int], forward_s: float = 0.02) -> list[dict]:
    """The from-scratch schedule (pp-naive, pp-gpipe-scratch, pp-1f1b-scratch) on sleeping
    stages, one step per m after a warm-up: the slowest rank's step time, the ideal
    m x (forward + backward) = 3 m forward_s, and this rank's event log."""
    import torch.distributed as dist

    from multigpu.strategies.pp_scratch import SCHEDULES, Pipeline

    stage, p = dist.get_rank(), dist.get_world_size()
    model = _stage(stage == 0, stage == p - 1, forward_s)
    pipe = Pipeline(model, dist.group.WORLD, stage, p, SCHEDULES[schedule])
    rows = []
    for m in ms:
        batches = _micro_batches(m)
        pipe.run(batches)  # warm-up: gloo's first messages, allocations
        step_s, start_unix = _timed(lambda b=batches: pipe.run(b))
        rows.append({"schedule": schedule, "implementation": "scratch", "p": p, "m": m, "v": 1,
                     "forward_s": forward_s, "step_s": step_s, "ideal_s": 3 * m * forward_s,
                     "events": pipe.events, "step_start_unix": start_unix})
    return rows


def library_bubble(schedule: str, ms: list[int], forward_s: float = 0.02) -> list[dict]:
    """The library's schedule (pp-gpipe, pp-1f1b, pp-interleaved, pp-zbv, pp-dualpipev) on
    sleeping stages; with v stages per rank each sleeps forward_s / v, so that a rank's ideal
    time is 3 m forward_s whatever v. Events: each forward (F), backward (B, or B and W
    apart under zero-bubble schedules) as the stage runs it."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from multigpu.models import loss_from_logits
    from multigpu.strategies.pp import SCHEDULES, StageModule, log_actions, stage_indices
    from multigpu.strategies.pp_scratch import ActionClock

    rank, p = dist.get_rank(), dist.get_world_size()
    kind = SCHEDULES[schedule]
    v, rows = kind.stages_per_rank, []
    total = p * v
    for m in ms:
        stages = [StageModule(_stage(i == 0, i == total - 1, forward_s / v), i, total, "cpu")
                  for i in stage_indices(kind, rank, p)]
        piped = [PipelineStage(s, s.index, total, torch.device("cpu")) for s in stages]
        clock = ActionClock(torch.device("cpu"))
        for ps in piped:
            log_actions(ps, clock)

        def loss_fn(out, labels, m=m):
            return loss_from_logits(out, labels) / m

        runner = (kind.cls(piped[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False) if v == 1 else
                  kind.cls(piped, n_microbatches=m, loss_fn=loss_fn, scale_grads=False))
        ids = torch.cat([b["input_ids"] for b in _micro_batches(m)])
        first, last = stages[0].index == 0, stages[-1].index == total - 1

        def step(ids=ids, runner=runner, first=first, last=last, clock=clock):
            clock.start_step()
            runner.step(*([ids] if first else []), target=ids if last else None, return_outputs=False)

        step()  # warm-up (the stages agree on shapes in their first step)
        step_s, start_unix = _timed(step)
        rows.append({"schedule": schedule, "implementation": "library", "p": p, "m": m, "v": v,
                     "forward_s": forward_s, "step_s": step_s, "ideal_s": 3 * m * forward_s,
                     "events": clock.events, "step_start_unix": start_unix})
    return rows
