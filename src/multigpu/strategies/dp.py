"""DataParallel: one process drives N replicas, one thread each.

Every step, `nn.DataParallel` (Li et al., "PyTorch Distributed", VLDB 2020, section 2) does
the eight steps of DP_STEPS below. On GPUs we use `nn.DataParallel` itself. On a CPU it only
passes the call through (its helpers refuse CPU tensors), so `ScratchDataParallel` does the
eight steps by hand, with threads and copies, and counts what every replica holds and how
long every step takes.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn

from multigpu.memory import CATEGORIES, optimizer_state_bytes, tensor_bytes
from multigpu.models import loss_from_logits
from multigpu.strategies import Parallelized, build_optimizer

DP_STEPS = [
    ("1. scatter", "split the input batch into N chunks, one per device"),
    ("2. replicate", "copy every parameter from the primary device to the others"),
    ("3. forward", "run the N forwards in parallel, one Python thread per device"),
    ("4. gather", "collect the N outputs on the primary device"),
    ("5. loss", "compute the loss there, on the whole batch's outputs"),
    ("6. backward", "send each device its slice of the outputs' gradient; N backwards in parallel"),
    ("7. reduce", "add the replicas' gradients into the primary's parameters"),
    ("8. update", "the optimizer steps on the primary alone"),
]


def logits_of(model: nn.Module, **inputs) -> torch.Tensor:
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits  # GPT returns logits, T5 an object


class _Logits(nn.Module):
    """The model without its loss, so that DataParallel gathers outputs, not N losses.
    nn.DataParallel's threads re-enter autocast with its default dtype (float16 on CUDA), so
    the caller's dtype is carried in `autocast` and restored here."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.autocast = {"device_type": "cuda", "enabled": False}

    def forward(self, **inputs):
        with torch.autocast(**self.autocast):
            return logits_of(self.model, **inputs)


class GPUDataParallel(nn.Module):
    """The real thing, as the sources use it: wrap, move, forward, loss on the primary GPU."""

    implementation = "torch.nn.DataParallel"

    def __init__(self, model: nn.Module, replicas: int):
        super().__init__()
        self.dp = nn.DataParallel(_Logits(model), device_ids=list(range(replicas)))
        self.replicas = replicas
        # the devices whose allocator peaks `report` reads: the training loop resets them all as
        # each step begins (ProcessPeaks.reset_also), so every replica's peak is the last step's
        self.peak_devices = [torch.device("cuda", i) for i in self.dp.device_ids]

    def forward(self, labels, **inputs):
        self.dp.module.autocast = {"device_type": "cuda", "enabled": torch.is_autocast_enabled("cuda"),
                                   "dtype": torch.get_autocast_dtype("cuda")}
        return loss_from_logits(self.dp(**inputs), labels)

    def report(self, optimizer) -> dict:
        """On GPUs the allocator measures each device's peak over the last step (the training
        loop resets every one of `peak_devices` as a step begins); categories are not split,
        so they are None (not measured)."""
        peaks = [torch.cuda.max_memory_allocated(d) for d in self.peak_devices]
        return {"implementation": self.implementation,
                "peak_memory_bytes_by_replica": [dict.fromkeys(CATEGORIES) | {"total": p} for p in peaks]}


@contextmanager
def _counting_saved(model: nn.Module, saved: list[int], i: int):
    """Add to saved[i] the bytes of what autograd saves for backward inside the block: each
    storage once, and not the model's own weights (they are parameters, counted apart).
    Saved-tensor hooks are per thread, so each replica thread counts its own."""
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(x):
        if x.untyped_storage().data_ptr() not in seen:
            seen.add(x.untyped_storage().data_ptr())
            saved[i] += x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
        yield


class ScratchDataParallel(nn.Module):
    """DataParallel's eight steps on one device, each replica in its own thread."""

    implementation = "from scratch: one thread per replica on the CPU"

    def __init__(self, model: nn.Module, replicas: int):
        super().__init__()
        self.model, self.n = model, replicas
        self.phase_s: dict[str, list[float]] = defaultdict(list)  # phase -> seconds, every call
        self.threads: dict[str, list[dict]] = {}  # phase -> per replica: start, end, cpu (last call)
        self.held = [dict.fromkeys(CATEGORIES, 0) for _ in range(replicas)]  # bytes, largest seen

    # -- the steps --------------------------------------------------------------------
    def forward(self, labels, **inputs):
        t = time.perf_counter()
        # 1. scatter: chunk i of every input goes to replica i
        chunks = [dict(zip(inputs, parts)) for parts in zip(*(v.chunk(self.n) for v in inputs.values()))]
        t = self._lap("scatter", t)
        # 2. replicate: replica 0 is the primary's model; the others are fresh copies, made
        # every step because the weights changed in the last update (tied weights stay tied)
        replicas = [self.model] + [copy.deepcopy(self.model) for _ in range(self.n - 1)]
        t = self._lap("replicate", t)
        # 3. parallel forward; each thread also counts what its forward saves for backward
        saved = [0] * self.n

        def forward_one(i):
            with _counting_saved(replicas[i], saved, i):
                return logits_of(replicas[i], **chunks[i])

        outputs = self._in_threads("forward", forward_one)
        t = self._lap("forward", t)
        # 4. gather the outputs onto the primary, as a new tensor that starts a new graph
        gathered = torch.cat([o.detach() for o in outputs]).requires_grad_()
        t = self._lap("gather", t)
        # 6.-7. run when backward has produced the gathered outputs' gradient (see below)
        gathered.register_post_accumulate_grad_hook(lambda g: self._backward(g, outputs, replicas))
        # 5. the loss, on the primary (what it saves for backward is the primary's too)
        with _counting_saved(self.model, saved, 0):
            loss = loss_from_logits(gathered, labels)
        self._lap("loss", t)
        self._hold(replicas, outputs, saved)
        return loss

    def _backward(self, gathered: torch.Tensor, outputs, replicas) -> None:
        t = time.perf_counter()
        # 6. scatter the gradient of the gathered outputs, then backward on every replica:
        # replica 0's gradients land in the primary's .grad, the others' are returned
        grad_chunks = gathered.grad.chunk(self.n)
        gathered.grad = None

        def backward_one(i):
            if i == 0:
                outputs[0].backward(grad_chunks[0])
                return None
            return torch.autograd.grad(outputs[i], list(replicas[i].parameters()), grad_chunks[i],
                                       allow_unused=True)  # a parameter this input did not use

        replica_grads = self._in_threads("backward", backward_one)
        t = self._lap("backward", t)
        # 7. reduce: add every replica's gradients into the primary's
        for j, primary in enumerate(self.model.parameters()):
            for grads in replica_grads[1:]:
                if grads[j] is None:
                    continue
                if primary.grad is None:
                    primary.grad = torch.zeros_like(primary)
                primary.grad.add_(grads[j])
        self._lap("reduce", t)

    # -- bookkeeping -------------------------------------------------------------------
    def _in_threads(self, phase: str, work) -> list:
        """work(i) for every replica i, each in its own thread; the caller's grad mode and
        autocast state go with them (both are per thread), and a replica's exception is
        raised here."""
        device = "cpu"
        autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device),
                        enabled=torch.is_autocast_enabled(device))
        grad_enabled = torch.is_grad_enabled()
        results, errors, timing = [None] * self.n, [], [None] * self.n

        def run(i):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                with torch.set_grad_enabled(grad_enabled), torch.autocast(**autocast):
                    results[i] = work(i)
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                errors.append(err)
            timing[i] = {"start": start, "end": time.perf_counter(), "cpu": time.thread_time() - cpu}

        threads = [threading.Thread(target=run, args=(i,), name=f"replica-{i}") for i in range(self.n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        self.threads[phase] = timing
        return results

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_s[phase].append(now - since)
        return now

    def _hold(self, replicas, outputs, saved) -> None:
        """Bytes each replica's tensors take during a step, counted tensor by tensor.
        Primary: the weights, their gradients, the optimizer state (added in `report`), its
        saved activations and the loss's, and the gathered outputs with their gradient. Replica i > 0: its
        copy of the weights, its gradients (until reduced), its saved activations, its
        output chunk and that chunk's gradient."""
        params = tensor_bytes(self.model.parameters())
        out = [tensor_bytes([o]) for o in outputs]
        for i in range(self.n):
            other = 2 * out[i] + (2 * sum(out) if i == 0 else 0)
            now = {"params": params, "grads": params, "optimizer": 0, "activations": saved[i], "other": other}
            self.held[i] = {c: max(self.held[i][c], now[c]) for c in CATEGORIES}

    def report(self, optimizer) -> dict:
        """What the record keeps: bytes per replica, seconds per phase (every call) and the
        threads' timing (last step)."""
        held = [dict(h) for h in self.held]
        held[0]["optimizer"] = optimizer_state_bytes(optimizer)  # the update happens on the primary only
        for h in held:
            h["total"] = sum(h[c] for c in CATEGORIES)
        return {
            "implementation": self.implementation,
            "peak_memory_bytes_by_replica": held,
            "phase_s": {k: v for k, v in self.phase_s.items()},
            "threads_last_step": self.threads,
        }


def launch_note(cfg, device: str) -> str:
    """What the launcher tells the reader this run will use (no backend: threads)."""
    from multigpu.runtime import machine_gpus, resolve_requested

    n, gpus = cfg.world_size, machine_gpus()
    reason = ("the CPU was asked for" if resolve_requested(cfg.device) == "cpu"
              else f"nn.DataParallel needs {n} CUDA GPUs, this machine has {gpus}")
    return (f"torch.nn.DataParallel on {n} CUDA GPUs" if device == "cuda"
            else f"DataParallel from scratch, {n} threads on the CPU ({reason})")


def prepare(model, cfg, rt) -> Parallelized:
    cls = GPUDataParallel if rt.device.type == "cuda" else ScratchDataParallel
    module = cls(model, cfg.world_size)
    optimizer = build_optimizer(model.parameters(), cfg)
    return Parallelized(module=module, optimizer=optimizer, model=model, report=lambda: module.report(optimizer),
                        counts_own_memory=True)
