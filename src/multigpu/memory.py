"""Measured peak memory, split into the categories the book reasons with.

PyTorch's `MemTracker` (torch.distributed._tools.mem_tracker) watches every tensor created
inside it and knows which are parameters, gradients, optimizer state and activations. It
works the same on CPU and CUDA tensors; on CUDA we also read the allocator's own peak.
At the moment of the total peak it gives a snapshot; we fold its categories into ours:

    params       Parameter + Buffer
    grads        Gradient
    optimizer    Optstate
    activations  Activation (tensors saved in forward for backward)
    other        Temp + Other: gradients of activations in backward, communication
                 buckets, anything else alive at the peak
"""

from __future__ import annotations

import torch

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
_FOLD = {
    "Parameter": "params", "Buffer": "params", "Gradient": "grads", "Optstate": "optimizer",
    "Activation": "activations", "Temp": "other", "Other": "other",
}


def empty_breakdown() -> dict[str, int]:
    return {c: 0 for c in CATEGORIES} | {"total": 0}


def fold_snapshot(snapshot: dict) -> dict[str, int]:
    """MemTracker's per-device peak snapshot -> our categories. On a GPU, the GPU's only:
    the host's peak (batches, a CPU optimizer's scalars, an offloaded optimizer) happens at
    another moment, and adding the two would make a peak that never was."""
    out = empty_breakdown()
    gpus = [d for d in snapshot if str(getattr(d, "type", d)).startswith("cuda")]
    for dev_snap in [snapshot[d] for d in gpus] if gpus else snapshot.values():
        for key, nbytes in dev_snap.items():
            name = getattr(key, "value", key)
            if name in _FOLD:
                out[_FOLD[name]] += int(nbytes)
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


class PeakMemoryTracker:
    """Memory of everything done inside the `with` block, which may span several forward
    passes (call `next_forward()` before each).

    After the block:
    - `by_category`: the categories alive at the moment of the peak (they sum to it);
    - `saved_activation_bytes`: activations alive when `model`'s forward returns, i.e. what
      forward keeps for backward (largest over the forwards seen). At the peak some of them
      may already be freed, so this is the number to compare across batch sizes.

    `model`: the plain model (not a wrapper such as DDP, whose own forward allocates
    communication buffers); `tracked`: objects created before the block (wrappers,
    optimizers, buffers) to count too."""

    def __init__(self, model, *tracked):
        from torch.distributed._tools.mem_tracker import MemTracker

        self.by_category = empty_breakdown()
        self.saved_activation_bytes = 0
        self._model = model
        self._tracker = MemTracker()
        self._tracker.track_external(model, *tracked)

    def __enter__(self):
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self._tracker.__exit__(*exc)
        self._collect_forward()
        self.by_category.update(fold_snapshot(self._tracker.get_tracker_snapshot("peak")))

    def next_forward(self) -> None:
        self._collect_forward()
        self._tracker.reset_mod_stats()  # per-module stats hold one forward; the peak stays

    def _collect_forward(self) -> None:
        stats = self._tracker.memory_tracking.get(self._model)
        if stats is None:
            return
        by_state = {getattr(state, "value", state): snaps for state, snaps in stats.snapshots.items()}
        # activations created by this forward and still alive when it returns: the
        # difference between the snapshots taken just before and just after it
        for before, after in zip(by_state.get("Pre-Forward", []), by_state.get("Post-Forward", [])):
            saved = fold_snapshot(after)["activations"] - fold_snapshot(before)["activations"]
            self.saved_activation_bytes = max(self.saved_activation_bytes, saved)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank stores: a DTensor's local shard, else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def model_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """What this rank holds between steps, by category: the bytes of every storage reached
    from the model's parameters and the optimizer's, their gradients, and the optimizer's
    state, each storage counted once. Counting storages, not tensors, is what makes sharding
    visible: a parameter that is a view into a freed buffer holds nothing, a flat buffer
    holds all its views once, and a DTensor (FSDP2) or a DeepSpeed partition (`ds_tensor`)
    holds its local shard only."""
    from torch._subclasses.fake_tensor import is_fake

    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's own
    params = [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    held = [_local(p) for p in params] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
    grads = [_local(p.grad) for p in params if p.grad is not None]
    state = list(_state_tensors(optimizer))
    seen, out = set(), {}
    for name, tensors in (("params", held), ("grads", grads), ("optimizer", state)):
        out[name] = 0
        for t in tensors:
            storage = _local(t).untyped_storage()
            # a dry run's fake tensors have no memory, hence no address: their storage objects tell them apart
            key = storage._cdata if is_fake(_local(t)) else (storage.device, storage.data_ptr())
            if key not in seen and storage.nbytes() > 0:
                seen.add(key)
                out[name] += storage.nbytes()
    return out


def _state_tensors(optimizer):
    """The optimizer's state tensors (not its scalar step counters)."""
    return (v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(_state_tensors(optimizer))


# bytes per parameter of each model state, as the ZeRO paper counts them
# (Rajbhandari et al. 2020, section 3.1): fp32 training keeps 4-byte parameters and
# gradients; mixed precision keeps 2-byte ones plus an fp32 master copy in the optimizer.
_OPTIMIZER_BYTES = {"sgd": 0, "sgd-momentum": 4, "adam": 8, "adamw": 8}  # fp32 state per parameter


def zero_model_states(parameters: int, world_size: int, stage: int, optimizer: str = "adamw",
                      dtype: str = "fp32") -> dict[str, float]:
    """Model-state bytes per rank under ZeRO stage 0 (plain data parallel) to 3.

    fp32: params 4, grads 4, optimizer K = 0/4/8 bytes per parameter (SGD, momentum, Adam).
    bf16-master: params 2, grads 2, optimizer K + 4 (the fp32 master weights); for Adam
    that is the paper's 2 + 2 + 12 (the paper's fp16; bf16 is as wide). The name is the
    estimator's and the command line's for the same accounting; "bf16-mixed" there means
    autocast over fp32 weights, which this function counts as fp32. Stage 1 divides the
    optimizer's share by N, stage 2 also the gradients', stage 3 also the parameters'."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dtype not in ("fp32", "bf16-master"):
        raise ValueError(f"zero_model_states counts dtype 'fp32' (also autocast's bf16-mixed: fp32 weights) or "
                         f"'bf16-master' (bf16 weights and gradients, an fp32 master copy), got {dtype!r}")
    low = dtype == "bf16-master"
    per_param = {"params": 2 if low else 4, "grads": 2 if low else 4,
                 "optimizer": _OPTIMIZER_BYTES[optimizer] + (4 if low else 0)}
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    return {k: parameters * b / (world_size if sharded[k] else 1) for k, b in per_param.items()}



def _proc_status(field: str) -> int | None:
    """A size from /proc/self/status (VmRSS, VmHWM), in bytes; None where there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class ProcessPeaks:
    """Each step's peak as the machine counts it, beside PeakMemoryTracker's count of live
    tensors: what a device must really hold, caching and fragmentation and temporaries the
    tracker does not see included.
    - CUDA: the caching allocator's peaks of the step, `max_memory_allocated` (tensors, rounded
      to the allocator's blocks) and `max_memory_reserved` (what it took from the GPU), the
      statistics reset as each step begins;
    - CPU (Linux): the resident set's high-water mark (VmHWM), reset as each step begins by
      writing 5 to /proc/self/clear_refs; glibc's malloc keeps much of what was freed, so a
      step starts from the resident set the last one left.
    Both are given above a baseline taken before the model was built (`begin`), so that they
    count what the tracker counts (the model, its gradients, optimizer state, activations) plus
    what only the machine sees. Where neither instrument exists, None.

    One process may drive several GPUs (dp: nn.DataParallel's replicas, whose peaks the
    strategy reads itself); `reset_also` names them, so that every step starts each one's
    peak from zero, as it does the process's own device's."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.reset_devices = [device]  # every CUDA device whose peak statistics a step starts from zero
        self.baseline = self._now()
        self.peak_by_step: list[int | None] = []
        self.reserved_by_step: list[int] = []
        self.absolute_peak = 0  # the allocator's peak over the run, not above the baseline

    def _now(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else _proc_status("VmRSS")

    def reset_also(self, devices) -> None:
        """Reset these devices' peaks too as each step begins (on CUDA; a CPU has one resident set)."""
        if self.cuda:
            self.reset_devices += [torch.device(d) for d in devices if torch.device(d) not in self.reset_devices]

    def start_step(self) -> None:
        if self.cuda:
            for device in self.reset_devices:
                torch.cuda.reset_peak_memory_stats(device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
        except OSError:
            self.baseline = None  # the mark cannot be reset: a step's peak cannot be told apart

    def end_step(self) -> None:
        if self.cuda:
            allocated = torch.cuda.max_memory_allocated(self.device)
            self.absolute_peak = max(self.absolute_peak, allocated)
            self.peak_by_step.append(allocated - self.baseline)
            self.reserved_by_step.append(torch.cuda.max_memory_reserved(self.device) - self.baseline)
            return
        mark = _proc_status("VmHWM")
        self.peak_by_step.append(None if mark is None or self.baseline is None else mark - self.baseline)

    def report(self) -> dict:
        known = [p for p in self.peak_by_step if p is not None]
        return {
            "instrument": "cuda caching allocator" if self.cuda else "resident set (VmHWM)" if known else None,
            "baseline_bytes": self.baseline,
            "peak_bytes": max(known) if known else None,
            "peak_bytes_by_step": self.peak_by_step,
            "reserved_bytes": max(self.reserved_by_step) if self.reserved_by_step else None,
        }
