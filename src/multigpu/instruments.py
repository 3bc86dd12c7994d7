"""What the training loop measures around each step, kept out of the loop (multigpu.train).

Steps 0 and 1 run under the memory tracker (step 0 creates the optimizer state, step 1 is a
steady-state step), step 2 under the communication counter (step 1 may still hold one-off
set-up traffic) and, where every rank talks over this machine's loopback, between barriers
that fence the wire's byte count; the steps after them are timed with nothing attached, so
the measurement tools never slow down the times we report; a run that asks for a profile runs
its last step under torch's profiler, untimed (multigpu.profiling). Every step's wall time and the
process's memory peak (memory.ProcessPeaks) are read on every rank.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack, contextmanager, nullcontext

import torch
import torch.distributed as dist

from multigpu.comm import CommCounter, loopback_tx_bytes
from multigpu.memory import CATEGORIES, PeakMemoryTracker, ProcessPeaks, empty_breakdown
from multigpu.profiling import StepProfiler
from multigpu.progress import PROGRESS_MARK


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Instruments:
    """`with instruments.step(step) as before_forward:` around one optimizer step; `results()`
    at the end: this rank's times, memory and traffic, for its record."""

    def __init__(self, cfg, rt, par, machine: ProcessPeaks, first_step: int = 0):
        """first_step: the steps a resumed run had done; `step(i)` counts this process's steps from 0."""
        self.cfg, self.rt, self.par, self.machine = cfg, rt, par, machine
        steps = cfg.steps - first_step
        # dp's replicas are threads, which the (per-thread) tracker would not see: dp counts its own
        self.track_memory = cfg.track_memory and not par.counts_own_memory
        self.last_tracked_step = min(1, steps - 1) if self.track_memory else -1
        self.comm_step = min(2, steps - 1)  # DDP re-plans its buckets on step 1 (a one-off broadcast)
        # extra["profile"]: the last step runs under torch's profiler, untimed (multigpu.profiling)
        self.profile_step = steps - 1 if cfg.extra.get("profile") else -1
        self.profile = None
        # all ranks on this machine talking over gloo: their traffic is the loopback's traffic
        self.measure_wire = rt.backend == "gloo" and rt.world_size > 1 and loopback_tx_bytes() is not None
        self.memory_tracker, self.comm, self.loopback_bytes = None, None, None
        self.step_times_s: list[float] = []
        self._tracking = ExitStack()

    @contextmanager
    def step(self, step: int):
        """Time one step (with the device's queue drained at both ends), under whatever measures
        this step; yields the `before_forward(i)` the step calls before micro-batch i's forward."""
        self.machine.start_step()
        if step == 0 and self.track_memory:
            par = self.par
            self.memory_tracker = PeakMemoryTracker(par.model, par.module, par.optimizer, *par.tracked)
            self._tracking.enter_context(self.memory_tracker)
        counting = step == self.comm_step
        counter = CommCounter(self.rt.world_size) if counting else nullcontext()
        if counting and self.measure_wire:
            # The counter is machine-wide, so the window must hold exactly this step's traffic:
            # everyone has finished the previous step, rank 0 reads, and only then may any rank
            # start sending (a ring's first chunks need no reply, so a rank that raced ahead
            # would send before the read). The barriers' own few hundred bytes count too.
            dist.barrier()
            wire_before = loopback_tx_bytes()
            dist.barrier()
        _synchronize(self.rt.device)
        start = time.perf_counter()
        tracker = self.memory_tracker if step <= self.last_tracked_step else None
        profiling = step == self.profile_step
        folder = self.cfg.extra["profile"] if profiling and self.cfg.extra["profile"] is not True else None
        profiler = StepProfiler(self.rt.device, self.rt.rank, folder) if profiling else nullcontext()
        with counter, profiler:
            yield (lambda i: tracker.next_forward()) if tracker else (lambda i: None)
            _synchronize(self.rt.device)
        self.step_times_s.append(time.perf_counter() - start)
        if profiling:
            self.profile = profiler.result(self.step_times_s[-1])
        self.machine.end_step()
        if step == self.last_tracked_step:
            self._tracking.close()
        if counting:
            self.comm = counter
            if self.measure_wire:
                dist.barrier()
                self.loopback_bytes = loopback_tx_bytes() - wire_before

    def progress(self, step: int, loss: float) -> None:
        """Rank 0's line for the launcher's live view (progress.py reads it)."""
        if self.rt.is_main:
            peak = self.machine.peak_by_step[-1]
            print(f"{PROGRESS_MARK} {step + 1} {self.cfg.steps} {loss:.6f} {self.step_times_s[-1]:.6f} "
                  f"{-1 if peak is None else peak}", flush=True)

    def results(self) -> dict:
        """The step time (median of the steps nothing was attached to), memory and traffic."""
        times, tracker, comm, own = self.step_times_s, self.memory_tracker, self.comm, self.par.counts_own_memory
        untracked = [t for s, t in enumerate(times)
                     if s > max(self.last_tracked_step, self.comm_step, 0) and s != self.profile_step]
        return {
            "step_times_s": times,
            "step_time_s": statistics.median(untracked or times) if times else None,  # None: no step (a reshard)
            "timed_steps": len(untracked) or len(times),
            "step_time_includes_tracking": not untracked,  # too few steps to time any cleanly
            "memory": tracker.by_category if tracker else dict.fromkeys([*CATEGORIES, "total"]) if own
            else empty_breakdown(),
            "saved_activation_bytes": tracker.saved_activation_bytes if tracker else None if own else 0,
            "cuda_allocator_peak_bytes": self.machine.absolute_peak if self.rt.device.type == "cuda" else None,
            "process_peak": self.machine.report(),
            "comm_calls": dict(comm.calls) if comm else {},
            "comm_payload_bytes": dict(comm.payload_bytes) if comm else {},
            "comm_sent_bytes": comm.sent_bytes if comm else {},
            "loopback_bytes": self.loopback_bytes,
            "profile": self.profile,
        }
