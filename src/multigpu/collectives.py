"""Collective communication: what it does, built from send and receive, and measured.

- `ring_all_reduce_steps` plays the ring all-reduce of Patarasuk and Yuan (2009) on plain
  Python numbers and returns every intermediate state, for step-by-step pictures.
- `naive_all_reduce`, `parameter_server_all_reduce`, `ring_all_reduce` build all-reduce
  from point-to-point sends and receives; `compare_with_library` checks them against
  `torch.distributed.all_reduce`.
- `demo` runs every collective once on telling values; `benchmark` times the all-reduces.

Everything after the simulation runs inside a process group: call it with
`multigpu.spmd.run_spmd("multigpu.collectives:<name>", world_size, ...)`.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist


def ring_all_reduce_steps(values: list[list[float]]) -> list[dict]:
    """values[r][c]: rank r's chunk c (N ranks, N chunks each). Returns one entry per step:
    {'phase', 'step', 'state' (deep copy), 'sent_chunks' (per rank)}.

    Reduce-scatter (N-1 steps): at step s rank r sends chunk (r - s) mod N to rank r+1,
    which adds it to its own. Afterwards rank r holds the full sum of chunk (r + 1) mod N.
    All-gather (N-1 steps): at step s rank r sends its finished chunk (r + 1 - s) mod N to
    rank r+1, which overwrites its copy. Each rank sends 2(N-1) chunks of size 1/N of the
    data: 2(N-1)/N of it, whatever N is."""
    n = len(values)
    state = [list(row) for row in values]
    history = [{"phase": "start", "step": 0, "state": [list(r) for r in state], "sent_chunks": [0] * n}]
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            offset = 0 if phase == "reduce-scatter" else 1
            # every rank sends at once; read all outgoing chunks before anyone updates
            outgoing = [(r, (r - s + offset) % n, state[r][(r - s + offset) % n]) for r in range(n)]
            for r, chunk, value in outgoing:
                dst = (r + 1) % n
                state[dst][chunk] = state[dst][chunk] + value if phase == "reduce-scatter" else value
                sent[r] += 1
            history.append({"phase": phase, "step": s + 1, "state": [list(r) for r in state],
                            "sent_chunks": list(sent)})
    return history


# -- all-reduce from send and receive ------------------------------------------------------
# Each function sums `tensor` over all ranks in place, as dist.all_reduce(tensor) does, and
# returns the bytes this rank sent. Sends and receives of one step go out together
# (batch_isend_irecv), so no pair of ranks waits on each other in the wrong order.

def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> int:
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return sum(t.numel() * t.element_size() for t, _ in sends)


def naive_all_reduce(tensor: torch.Tensor) -> int:
    """Everyone sends everything to everyone: N-1 copies of the data leave every rank.
    Every rank adds the N tensors in rank order, so all get the same bits."""
    rank, n = dist.get_rank(), dist.get_world_size()
    peers = [p for p in range(n) if p != rank]
    received = dict(zip(peers, (torch.empty_like(tensor) for _ in peers)))
    sent = _exchange([(tensor, p) for p in peers], [(buf, p) for p, buf in received.items()])
    received[rank] = tensor.clone()
    tensor.copy_(received[0])
    for r in range(1, n):
        tensor += received[r]
    return sent


def parameter_server_all_reduce(tensor: torch.Tensor, server: int = 0) -> int:
    """Workers send to one server, which sums and sends the total back: the server sends and
    receives N-1 copies, every other rank one copy each way (the hot spot)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != server:
        sent = _exchange([(tensor, server)], [])
        _exchange([], [(tensor, server)])
        return sent
    workers = [p for p in range(n) if p != server]
    received = [torch.empty_like(tensor) for _ in workers]
    _exchange([], list(zip(received, workers)))
    for r in received:
        tensor += r
    return _exchange([(tensor, p) for p in workers], [])


def ring_reduce_scatter(tensor: torch.Tensor) -> int:
    """First half of the ring: N-1 steps; at step s rank r sends its partial sum of chunk
    (r - s) mod N to the right and adds what arrives from the left. Afterwards rank r holds
    the full sum of chunk (r + 1) mod N. Chunks are uneven when N does not divide the size."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), n))  # views: updates land in `tensor`
    incoming = torch.empty_like(chunks[0])  # the largest chunk (tensor_split puts extras first)
    sent = 0
    for s in range(n - 1):
        out_c, in_c = (rank - s) % n, (rank - s - 1) % n
        buf = incoming[: chunks[in_c].numel()]
        sent += _exchange([(chunks[out_c], (rank + 1) % n)], [(buf, (rank - 1) % n)])
        chunks[in_c] += buf
    return sent


def ring_all_gather(tensor: torch.Tensor) -> int:
    """Second half: N-1 steps passing the finished sums around; rank r starts with chunk
    (r + 1) mod N and at step s sends chunk (r + 1 - s) mod N to the right."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    sent = 0
    for s in range(n - 1):
        out_c, in_c = (rank + 1 - s) % n, (rank - s) % n
        sent += _exchange([(chunks[out_c], (rank + 1) % n)], [(chunks[in_c], (rank - 1) % n)])
    return sent


def ring_all_reduce(tensor: torch.Tensor) -> int:
    """Reduce-scatter then all-gather around the ring: 2(N-1) steps of one chunk each, so
    each rank sends 2(N-1)/N of the data whatever N is."""
    return ring_reduce_scatter(tensor) + ring_all_gather(tensor)


# The library's collectives do not say what they send: they return None, and the
# loopback counter measures it.

def library_all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def library_reduce_scatter(tensor: torch.Tensor) -> None:
    """Reduce-scatter `tensor` (size divisible by N) into this rank's shard."""
    shard = torch.empty(tensor.numel() // dist.get_world_size(), dtype=tensor.dtype)
    dist.reduce_scatter_single(shard, tensor.view(-1))


def library_all_gather(tensor: torch.Tensor) -> None:
    """All-gather this rank's shard of `tensor` (size divisible by N) into all of it."""
    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    size = flat.numel() // n
    shard = flat[rank * size:(rank + 1) * size].clone()
    dist.all_gather_single(flat, shard)


ALL_REDUCES = {
    "naive": naive_all_reduce,
    "parameter server": parameter_server_all_reduce,
    "ring": ring_all_reduce,
    "library": library_all_reduce,
}
# the two halves of an all-reduce, ours and the library's: the bridge to ZeRO
HALVES = {
    "ring reduce-scatter": ring_reduce_scatter,
    "ring all-gather": ring_all_gather,
    "library reduce-scatter": library_reduce_scatter,
    "library all-gather": library_all_gather,
}


def compare_with_library(sizes: list[int], dtypes: list[str], seed: int = 0) -> list[dict]:
    """Run under `run_spmd`: every all-reduce above on the same inputs as dist.all_reduce.

    Two inputs per case: small whole numbers, whose sums are exact in any order (so the
    results must be equal bit for bit), and random normals (equal up to rounding, since the
    sums run in another order). Returns, per algorithm, size and dtype, this rank's largest
    difference from the library, a digest of its result (all ranks must hold the same
    bits) and the bytes it sent."""
    rank = dist.get_rank()
    out = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for size in sizes:
            g = torch.Generator().manual_seed(seed * 1000 + rank)
            inputs = {"whole numbers": torch.randint(-8, 9, (size,), generator=g).to(dtype),
                      "random": torch.randn(size, generator=g).to(dtype)}
            for kind, x in inputs.items():
                expected = x.clone()
                dist.all_reduce(expected)
                for name, algorithm in ALL_REDUCES.items():
                    ours = x.clone()
                    sent = algorithm(ours)
                    out.append({"algorithm": name, "size": size, "dtype": dtype_name, "input": kind,
                                "max_abs_diff": (ours.float() - expected.float()).abs().max().item(),
                                "digest": hashlib.sha1(ours.view(torch.uint8).numpy().tobytes()).hexdigest(),
                                "sent_bytes": sent})
    return out


# -- what each collective does, on real tensors -------------------------------------------

def demo() -> list[dict]:
    """Run under `run_spmd`: each collective of torch.distributed once, on values that say
    where they came from (rank r holds 10(r+1) + c at position c, so rank 1 of 4 holds
    20 21 22 23, and a sum over 4 ranks starts at 100). Returns this rank's tensor before
    and after each; None where the collective leaves a rank nothing defined."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def mine(length=n):
        return torch.tensor([10 * (rank + 1) + c for c in range(length)], dtype=torch.int64)

    rows = []

    def show(name, before, after):
        rows.append({"collective": name, "before": before.tolist(), "after": None if after is None else after.tolist()})

    x = mine()
    dist.broadcast(x, src=0)
    show("broadcast (from rank 0)", mine(), x)
    x = mine()
    dist.reduce(x, dst=0)  # only the destination's result is defined
    show("reduce (to rank 0)", mine(), x if rank == 0 else None)
    x = mine()
    dist.all_reduce(x)
    show("all-reduce", mine(), x)
    out = torch.empty(1, dtype=torch.int64)
    dist.reduce_scatter_single(out, mine())
    show("reduce-scatter", mine(), out)
    out = torch.empty(n, dtype=torch.int64)
    dist.all_gather_single(out, mine(1))
    show("all-gather", mine(1), out)
    out = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(out, mine())
    show("all-to-all", mine(), out)
    x = torch.empty(n, dtype=torch.int64)
    _exchange([(mine(), (rank + 1) % n)], [(x, (rank - 1) % n)])
    show("send / recv (to the right)", mine(), x)
    return rows


# -- how fast, and how many bytes --------------------------------------------------------

def benchmark(sizes: list[int], algorithms: list[str], min_time_s: float = 0.3, max_reps: int = 20) -> list[dict]:
    """Run under `run_spmd`: time each all-reduce on float32 tensors of each size (bytes).

    Per (size, algorithm): one warm-up call, then as many timed calls as fit in about
    `min_time_s` (3 to `max_reps`; rank 0 decides, so every rank runs the same number), each
    between barriers. Returns this rank's seconds per call, the bytes it counted sending,
    and (rank 0) the loopback interface's bytes per call, all ranks together."""
    from multigpu.comm import loopback_tx_bytes

    rank, n = dist.get_rank(), dist.get_world_size()
    bad = [s for s in sizes if s % (4 * n)]
    if bad:
        raise ValueError(f"sizes {bad} are not whole numbers of float32 elements divisible by "
                         f"{n} ranks; use multiples of {4 * n} bytes")
    unknown = [a for a in algorithms if a not in ALL_REDUCES | HALVES]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; choose from {[*ALL_REDUCES, *HALVES]}")
    rows = []
    for size in sizes:
        x = torch.ones(size // 4)
        for name in algorithms:
            algorithm = (ALL_REDUCES | HALVES)[name]
            dist.barrier()
            start = time.perf_counter()
            sent = algorithm(x)
            warm = torch.tensor([time.perf_counter() - start])
            dist.broadcast(warm, src=0)
            reps = int(min(max_reps, max(3, min_time_s / max(warm.item(), 1e-9))))
            times = []
            dist.barrier()
            wire_before = loopback_tx_bytes()
            dist.barrier()
            for _ in range(reps):
                x.fill_(1.0)
                dist.barrier()
                start = time.perf_counter()
                algorithm(x)
                times.append(time.perf_counter() - start)
            dist.barrier()
            wire = loopback_tx_bytes()
            rows.append({"size_bytes": size, "algorithm": name, "times_s": times, "sent_bytes": sent,
                         "loopback_bytes_per_call": (wire - wire_before) / reps
                         if rank == 0 and wire is not None else None})
            print(f"@@multigpu-progress {len(rows)} {len(sizes) * len(algorithms)}", flush=True)
    return rows
