"""The device rule, checked on a CPU: every tensor that the training path hands to a collective
or point-to-point call lives on the rank's device.

NCCL moves only CUDA tensors: a CPU tensor handed to it raises "No backend type associated
with device type cpu" (a process group made for NCCL alone has no CPU backend). On a CPU run
(gloo) every tensor is on the CPU, so a tensor made without naming a device passes every test
there and fails on the first GPU machine: a pipeline's loss broadcast as `torch.tensor([loss])`
did exactly that (review finding G2).

With MULTIGPU_DEVICE_GUARD=1 in its environment (the test suite sets it, so every worker it
starts runs guarded), a worker watches where tensors come from:
- a tensor made by a factory (`torch.tensor`, `as_tensor`, `zeros`, `empty`, ...) without a
  device is marked as made on the host by default;
- what is computed from marked tensors alone is marked too (`torch.cat` of two, a `.view`);
- `.to(device)` / `.cuda()`, or any call given `device=`, remove the mark: the code said where
  the tensor belongs.
A marked tensor handed to `torch.distributed`'s collectives by this package's code raises
`DeviceRuleError`, naming the call and where the tensor was made. Libraries' own calls (FSDP,
DeepSpeed, pipelining) are theirs to get right and are not checked. What it cannot see: a
tensor moved to the CPU explicitly (`.cpu()`, `device="cpu"`): on a CPU run `.cpu()` returns the
same tensor, so marking it would mark the rank's own device tensors; for the same reason a
`x.to(device)` whose result is dropped unmarks `x`; and `torch.from_numpy` /`frombuffer`, which
the function mode does not see.

The guard checks this one rule. NCCL's other rules go unchecked on a CPU (review gpu-path-3, G19):
- which CUDA device a thread other than the main one uses (a new thread's is device 0: DCP's
  background writer, G13);
- the rule's reverse: a library moving the package's host tensors onto the GPU (`DTensor.from_local`
  moves a local tensor to its mesh's device, G12);
- the order of point-to-point messages: NCCL matches them by order, not tag, so two exchanges of
  tensors of one shape stay apart only by being posted in the same order on every rank (ring
  attention's backward checks its own order at post time, `cp_attention._PostOrder`);
- where object collectives put their buffers (`all_gather_object` and DCP's plans go through the
  GPU under NCCL, so a large pickled object lands on every rank's device);
- NCCL's table of dtypes and ops (no int16; a bool SUM is a MAX; AVG and PREMUL_SUM): the guard
  sees dtypes and ops the same on both backends.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

GUARD_ENV = "MULTIGPU_DEVICE_GUARD"
_MARK = "_multigpu_made_on_host"  # attribute on a marked tensor: where it was made
_PACKAGE = str(Path(__file__).resolve().parent)

# factories whose result lands on the default (host) device unless given one
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty, torch.full,
              torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
              torch.randperm, torch.empty_strided, torch.scalar_tensor}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}  # with a device: the tensor now lives where the code said
# the calls that hand tensors to a backend, and where their tensors are among the arguments
_CALLS = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
          "scatter", "gather", "send", "recv", "batch_isend_irecv")
# (isend and irecv are checked inside batch_isend_irecv's P2POps: torch compares the op of a
# P2POp with its own isend/irecv, so those two must stay unwrapped)


class DeviceRuleError(RuntimeError):
    """A tensor made on the host by default was handed to a collective."""


def _made_where() -> str:
    """file:line of the innermost frame of this package's code (or of the caller)."""
    frame = sys._getframe(2)
    first = None
    while frame is not None:
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        first = first or where
        if frame.f_code.co_filename.startswith(_PACKAGE) and frame.f_code.co_filename != __file__:
            return where
        frame = frame.f_back
    return first or "?"


def _names_a_device(func, args, kwargs) -> bool:
    """Whether a `.to(...)`/`.cuda(...)` call says where the tensor goes."""
    if func is torch.Tensor.cuda:
        return True
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool)
               for a in args[1:])


def _marked_input(args) -> torch.Tensor | None:
    """The first marked tensor among the arguments (and in lists of them, as torch.cat takes),
    or None: the common case, found without flattening every call's arguments."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if hasattr(a, _MARK):
                return a
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor) and hasattr(t, _MARK):
                    return t
    return None


class HostTensors(TorchFunctionMode):
    """Marks tensors made on the host by default, and what is computed from them alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if func in _FACTORIES:
            if kwargs.get("device") is None and not any(isinstance(a, torch.Tensor) for a in args):
                setattr(out, _MARK, _made_where())
            return out
        marked = _marked_input(args)
        if marked is None:  # nothing made on the host went in: nothing to follow
            return out
        if kwargs.get("device") is not None and out is not marked:  # zeros_like(x, device=...): placed
            return out
        if func in _MOVES:
            if _names_a_device(func, args, kwargs):
                if hasattr(out, _MARK):
                    delattr(out, _MARK)
            elif out is not marked:
                setattr(out, _MARK, getattr(marked, _MARK))  # .to(dtype): still on the host
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(out is t for t in inputs):  # in place: the tensor stays where it was
            return out
        if all(hasattr(t, _MARK) for t in inputs):
            setattr(out, _MARK, getattr(marked, _MARK))
        return out


def _check(name: str, args, kwargs) -> None:
    caller = sys._getframe(2).f_code.co_filename
    if not caller.startswith(_PACKAGE):  # a library's own call: not ours to check
        return
    leaves = tree_flatten((args, kwargs))[0]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    tensors += [op.tensor for op in leaves if isinstance(op, dist.P2POp)]
    for tensor in tensors:
        where = getattr(tensor, _MARK, None)
        if where is not None:
            frame = sys._getframe(2)
            raise DeviceRuleError(
                f"dist.{name} at {frame.f_code.co_filename}:{frame.f_lineno} was handed a tensor made on the host "
                f"by default (at {where}): under NCCL this raises 'No backend type associated with device type "
                "cpu'. Make it on the rank's device (device=rt.device, or the device of a tensor it came from) "
                "or move it there with .to(device) before the call")


def _guarded(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _check(name, args, kwargs)
        return fn(*args, **kwargs)

    call._multigpu_guarded = True
    return call


@contextmanager
def watching():
    """Within: tensors made on the host are marked, and every collective this package calls is
    checked (a test's scope)."""
    originals = {name: getattr(dist, name) for name in _CALLS if hasattr(dist, name)}
    for name, fn in originals.items():
        if not getattr(fn, "_multigpu_guarded", False):
            setattr(dist, name, _guarded(name, fn))
    try:
        with HostTensors():
            yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


_installed = []


def install_if_asked() -> bool:
    """Watch this process for the rest of its life when MULTIGPU_DEVICE_GUARD=1 (a torchrun
    worker started by the test suite); whether it does."""
    if os.environ.get(GUARD_ENV, "") in ("", "0"):
        return False
    if not _installed:
        context = watching()
        context.__enter__()
        _installed.append(context)
    return True
