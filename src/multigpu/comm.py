"""Per-rank accounting of collectives: calls and bytes, by kind.

`CommCounter` is a TorchDispatchMode: every collective that goes through PyTorch's
dispatcher (`torch.distributed.*`, DDP's C++ reducer, FSDP, tensor parallel) passes
through `__torch_dispatch__`, where we read the kind and the tensor sizes.

Two numbers per kind:
- payload bytes: the size of the tensor(s) this rank handed to the collective;
- bytes sent: what a bandwidth-optimal (ring) algorithm makes each rank send for that
  payload on N ranks, e.g. 2(N-1)/N x payload for all-reduce. Backends choose their own
  algorithms, so this is the textbook cost of the measured payload, not a packet count.

What really crossed the wire is measured separately where it can be: when all ranks run on
one machine over gloo, their traffic goes through the loopback interface, whose byte
counter (`loopback_tx_bytes`) we read before and after a step.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# dispatcher op name -> collective kind
OP_KINDS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}


def sent_bytes(kind: str, payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends for `payload_bytes` of input under the ring algorithm."""
    n = world_size
    if n == 1:
        return 0.0
    factor = {
        "all_reduce": 2 * (n - 1) / n,  # reduce-scatter then all-gather
        "reduce_scatter": (n - 1) / n,  # payload = the full, unscattered input
        "all_gather": n - 1,  # payload = this rank's shard; it travels to n-1 others
        "all_to_all": (n - 1) / n,
        "reduce": (n - 1) / n,
        "broadcast": 1.0,  # pipelined: every rank but the last forwards the message
        "send": 1.0,
        "recv": 0.0,
        "gather": 1.0,
        "scatter": (n - 1) / n,
    }[kind]
    return factor * payload_bytes


# c10d ops that take (outputs, inputs): their payload is argument 1, not argument 0
_INPUT_IS_SECOND = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                    "reduce_scatter_", "_reduce_scatter_base_", "alltoall_", "alltoall_base_",
                    "gather_"}


def _payload_bytes(func, args) -> int:
    """Bytes of the tensor(s) this rank hands to the collective as input."""
    index = 1 if func.namespace == "c10d" and func._opname in _INPUT_IS_SECOND else 0
    tensors, _ = tree_flatten(args[index] if len(args) > index else ())
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _group_size(args) -> int | None:
    """The size of the group a collective's arguments name: a c10d op passes the ProcessGroup (boxed as a
    ScriptObject), a functional collective its registered name."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # another boxed argument (the ReduceOp)
                continue
        if isinstance(a, str):
            try:
                return _resolve_process_group(a).size()
            except (KeyError, RuntimeError, ValueError):
                continue
    return None


class CommCounter(TorchDispatchMode):
    """Count collectives issued inside the `with` block.

    >>> with CommCounter(world_size) as comm:
    ...     loss.backward()
    >>> comm.payload_bytes  # {'all_reduce': 449536}
    """

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.calls: dict[str, int] = defaultdict(int)
        self.payload_bytes: dict[str, int] = defaultdict(int)
        self.log: list[tuple[str, int]] = []  # (kind, payload bytes) in the order issued
        self.group_sizes: list[int | None] = []  # each call's group's size, in the same order (None: not named)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # A mode runs before tensor subclasses: an op on DTensors (tensor parallel's
            # loss_parallel, say) would reach us whole, and the collectives DTensor then
            # issues for it would pass unseen. Declining lets DTensor run first; its
            # collectives, on plain tensors, come back through here (as CommDebugMode does).
            return NotImplemented
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = OP_KINDS.get(func._opname)
            if kind is not None:
                payload = _payload_bytes(func, args)
                self.calls[kind] += 1
                self.payload_bytes[kind] += payload
                self.log.append((kind, payload))
                self.group_sizes.append(_group_size(args))
        return func(*args, **(kwargs or {}))

    @property
    def sent_bytes(self) -> dict[str, float]:
        return {k: sent_bytes(k, b, self.world_size) for k, b in self.payload_bytes.items()}


def loopback_tx_bytes() -> int | None:
    """Bytes transmitted so far on this machine's loopback interface (Linux), or None.

    Every byte one local process sends another over TCP is counted once here (plus TCP/IP
    headers), so the difference across a step, divided by N, is what each of N ranks sent."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # receive has 8 fields, then transmit bytes
    except (OSError, ValueError, IndexError):
        return None
    return None


# -- the link as a latency-bandwidth (alpha-beta) model ----------------------------------
# A collective of one call that makes each rank send S bytes takes about
#     t = alpha + beta * S
# alpha: the fixed cost of a call (latency, synchronisation, launching the algorithm);
# beta: seconds per byte sent (1 / bandwidth). Hockney's model, as in Thakur et al.,
# "Optimization of Collective Communication Operations in MPICH" (2005). Fitted to timed
# calls of one collective on one machine, it turns the bytes a strategy sends into seconds.


def fit_alpha_beta(sent_bytes_per_call: list[float], seconds_per_call: list[float]) -> dict:
    """Least-squares line through (bytes sent, seconds) points, weighted by 1/t so that the
    small messages (where alpha shows) count as much as the large ones (where beta shows).
    Returns {"alpha_s", "beta_s_per_byte", "bandwidth_bytes_per_s", "worst_relative_error"}."""
    import numpy as np

    if len(sent_bytes_per_call) < 2:
        raise ValueError("an alpha-beta fit needs at least two message sizes")
    s = np.asarray(sent_bytes_per_call, dtype=float)
    t = np.asarray(seconds_per_call, dtype=float)
    w = 1.0 / t  # minimise the relative error of each point
    a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    alpha, beta = max(float(alpha), 0.0), max(float(beta), 1e-18)
    predicted = alpha + beta * s
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_bytes_per_s": 1.0 / beta,
            "worst_relative_error": float(np.max(np.abs(predicted - t) / t))}


def predicted_seconds(log: list[tuple[str, int]], world_size: int, fits: dict[str, dict]) -> float:
    """Seconds that the collectives of `log` ((kind, payload bytes) as CommCounter records
    them) take under the alpha-beta `fits` (kind -> fit) of a link with `world_size` ranks."""
    return sum(fits[kind]["alpha_s"] + fits[kind]["beta_s_per_byte"] * sent_bytes(kind, payload, world_size)
               for kind, payload in log)
