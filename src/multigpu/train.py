"""The one training loop every strategy shares.

The loop owns the data, the clock and the instruments; the step itself (forward and
backward over the micro-batches, then the update) is a function the strategy provides
(`Parallelized.run_step`: the plain micro-batch step, or a pipeline schedule).

Per step it records wall time and the loss. Steps 0 and 1 run under the memory tracker
(step 0 creates the optimizer state, step 1 is a steady-state step), step 2 under the
communication counter (step 1 may still hold one-off set-up traffic); the steps after them
are timed with nothing attached, so the measurement tools never slow down the times we report.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import time
from contextlib import ExitStack, nullcontext

import torch
import torch.distributed as dist

from multigpu import strategies
from multigpu.comm import CommCounter, loopback_tx_bytes
from multigpu.config import RunConfig, parse_fault
from multigpu.data import TokenDataset, batches, make_loader
from multigpu.memory import CATEGORIES, PeakMemoryTracker, ProcessPeaks, empty_breakdown, model_state_bytes
from multigpu.models import build_model, default_seq_len, vocab_size
from multigpu.runtime import RankGrid

# rank 0 prints one line per step: the mark, steps done, steps, loss, step time (s), the step's
# peak as the machine counts it (ProcessPeaks, bytes; -1 unknown); the launcher draws a bar, or in
# a notebook a live figure
PROGRESS_MARK = "@@multigpu-progress"


def _maybe_fail(cfg: RunConfig, rank: int, step: int) -> None:
    """Testing hook: make one rank fail at one step, to prove failures never hang."""
    if cfg.fault is None:
        return
    kind, fault_rank, fault_step = parse_fault(cfg.fault)
    if (rank, step) == (fault_rank, fault_step):
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault on rank {rank} at step {step} (fault={cfg.fault!r})")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(cfg: RunConfig, rt, keep_params: bool = False) -> dict:
    """Train `cfg.steps` optimizer steps; return this rank's measurements, and with
    `keep_params` the whole trained weights (gathered from the shards: only when asked,
    because a full copy of a large model costs as much memory as the model)."""
    rt.grid = RankGrid.build(rt.device.type, cfg.process_grid)
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    machine = ProcessPeaks(rt.device)  # its baseline: before the model exists
    model = build_model(cfg.model, cfg.seed)
    model.to(rt.device)
    parameters = sum(p.numel() for p in model.parameters())  # before sharding hides them
    par = strategies.prepare(model, cfg, rt)
    # from here on the strategy's own references keep what it trains (par.model, its stages);
    # ours would keep the whole model alive, on the device, until training ends, wherever a
    # strategy trains copies or pieces of it rather than the model itself
    del model
    # a process driving several GPUs (dp) reads every one's peak: each step resets them all
    machine.reset_also(getattr(par.module, "peak_devices", ()))

    seq_len = cfg.seq_len or default_seq_len(cfg.model)
    dataset = TokenDataset(cfg.model, cfg.dataset, cfg.num_samples, seq_len, vocab_size(cfg.model), cfg.seed)
    # data are split by data-parallel rank: the ranks of one tensor-parallel group (and of
    # one pipeline) see the same samples. A process's share of a micro-step (dp: one
    # process feeds all its replicas)
    dp_rank, dp_size = rt.grid.coord("dp"), rt.grid.size("dp")
    process_batch = cfg.global_batch_size // (dp_size * cfg.grad_accum_steps)
    loader, sampler = make_loader(dataset, process_batch, dp_rank, dp_size, cfg.seed)
    micro_steps_per_epoch = (cfg.num_samples // cfg.global_batch_size) * cfg.grad_accum_steps
    data = batches(loader, sampler, micro_steps_per_epoch, cfg.steps * cfg.grad_accum_steps)
    # mixed precision: forward under autocast to this dtype, weights and optimizer in fp32
    # (fp16-mixed also scales the loss: par.scaler, set by strategies.prepare)
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(cfg.dtype)

    losses, step_times_s = [], []
    memory_tracker, comm = None, None
    # dp's replicas are threads, which the (per-thread) tracker would not see: dp counts its own
    track_memory = cfg.track_memory and not par.counts_own_memory
    last_tracked_step = min(1, cfg.steps - 1) if track_memory else -1
    comm_step = min(2, cfg.steps - 1)  # DDP re-plans its buckets on step 1 (a one-off broadcast)
    tracking = ExitStack()
    # all ranks on this machine talking over gloo: their traffic is the loopback's traffic
    measure_wire = rt.backend == "gloo" and rt.world_size > 1 and loopback_tx_bytes() is not None
    loopback_bytes = None

    for step in range(cfg.steps):
        _maybe_fail(cfg, rt.rank, step)
        machine.start_step()
        if step == 0 and track_memory:
            memory_tracker = PeakMemoryTracker(par.model, par.module, par.optimizer, *par.tracked)
            tracking.enter_context(memory_tracker)
        counter = CommCounter(rt.world_size) if step == comm_step else nullcontext()
        if step == comm_step and measure_wire:
            # The counter is machine-wide, so the window must hold exactly this step's traffic:
            # everyone has finished the previous step, rank 0 reads, and only then may any rank
            # start sending (a ring's first chunks need no reply, so a rank that raced ahead
            # would send before the read). The barriers' own few hundred bytes count too.
            dist.barrier()
            wire_before = loopback_tx_bytes()
            dist.barrier()
        _synchronize(rt.device)
        start = time.perf_counter()
        with counter:
            micro_batches = [{k: v.to(rt.device, non_blocking=True) for k, v in next(data).items()}
                             for _ in range(cfg.grad_accum_steps)]
            mark = (lambda i, t=memory_tracker: t.next_forward()) if step <= last_tracked_step else (lambda i: None)
            step_loss = par.run_step(micro_batches, autocast_dtype, mark)
        if not math.isfinite(step_loss):  # every strategy's run stops here, nothing is recorded
            raise FloatingPointError(
                f"training diverged at step {step}: the loss is {step_loss} (after "
                f"{', '.join(f'{x:.4g}' for x in losses[-3:]) or 'no finite step'}); likely causes: a learning "
                f"rate too high (lr={cfg.lr:g}: try 10x smaller), or half precision without loss scaling")
        _synchronize(rt.device)
        step_times_s.append(time.perf_counter() - start)
        machine.end_step()
        if step == last_tracked_step:
            tracking.close()
        if step == comm_step:
            comm = counter
            if measure_wire:
                dist.barrier()
                loopback_bytes = loopback_tx_bytes() - wire_before
        losses.append(step_loss)
        if rt.is_main:
            peak = machine.peak_by_step[-1]
            print(f"{PROGRESS_MARK} {step + 1} {cfg.steps} {step_loss:.6f} {step_times_s[-1]:.6f} "
                  f"{-1 if peak is None else peak}", flush=True)

    model_states = model_state_bytes(par.module, par.optimizer)  # what this rank holds between steps
    not_measured = dict.fromkeys([*CATEGORIES, "total"])
    untracked = [t for s, t in enumerate(step_times_s) if s > max(last_tracked_step, comm_step, 0)]
    return {
        "rank": rt.rank,
        "loss": losses,
        "step_times_s": step_times_s,
        "step_time_s": statistics.median(untracked or step_times_s),
        "timed_steps": len(untracked) or len(step_times_s),
        "step_time_includes_tracking": not untracked,  # too few steps to time any cleanly
        "model_states": model_states,
        "memory": memory_tracker.by_category if memory_tracker else not_measured if par.counts_own_memory
        else empty_breakdown(),
        "saved_activation_bytes": memory_tracker.saved_activation_bytes if memory_tracker
        else None if par.counts_own_memory else 0,
        "cuda_allocator_peak_bytes": machine.absolute_peak if rt.device.type == "cuda" else None,
        "process_peak": machine.report(),
        "comm_calls": dict(comm.calls) if comm else {},
        "comm_payload_bytes": dict(comm.payload_bytes) if comm else {},
        "comm_sent_bytes": comm.sent_bytes if comm else {},
        "loopback_bytes": loopback_bytes,
        "strategy_report": {**(par.report() if par.report else {}),
                            **({"loss_scaling": par.scaler.report()} if par.scaler else {})},
        "state_dict": par.full_state_dict() if keep_params else None,
        "seq_len": seq_len,
        "parameters": parameters,
    }
