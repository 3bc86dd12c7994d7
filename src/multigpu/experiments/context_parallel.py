"""The experiments of chapter "Context parallelism": memory per rank as the sequence grows and cp
cuts it, the bytes each attention variant moves, the causal mask's work per rank under the two
layouts, and the longest sequence a rank's memory takes, predicted and measured.

All on gpt-long (narrow, 16,384 positions), one sample a step, so that the sequence is what
fills memory. On a CPU every rank is a process with one thread (as one GPU a rank); on GPUs
the same runs go to NCCL where there are enough of them.
"""

from __future__ import annotations

import time

from multigpu import records
from multigpu.config import RunConfig
from multigpu.experiments.machine import Job, ddp_device, max_world_size, on_gpus

MODEL = "gpt-long"
# a rank's memory in the longest-sequence search: a stand-in for a GPU's, sized so that one rank
# and four reach different lengths below the model's 16,384 positions
CPU_BUDGET = 96 * 2**20
SEQ_STEP = 512  # the search's grain: a multiple of 2 x cp for every cp it tries


def _base(seq_len: int) -> RunConfig:
    return RunConfig(model=MODEL, global_batch_size=1, seq_len=seq_len, steps=3, optimizer="adamw", lr=1e-3,
                     dataset="dummy", device=ddp_device(), threads_per_worker=None if on_gpus(2) else 1)


def _degrees() -> list[int]:
    return [cp for cp in (2, 4, 8) if cp <= max_world_size()]


def _at(seq_len: int, cp: int, **extra) -> RunConfig:
    base = _base(seq_len)
    return base if cp == 1 else base.replace(strategy="cp-scratch", world_size=cp, extra=dict(extra))


def cp_memory() -> list[RunConfig]:
    """Memory by category on each rank, one device and cp ranks (ring attention, zig-zag), as the
    sequence doubles: a rank's activations are its tokens' and fall as 1/cp."""
    return [_at(seq, cp) for seq in (2048, 4096, 8192, 16384) for cp in (1, *_degrees())]


def cp_variants() -> list[RunConfig]:
    """Every attention variant and both layouts on 2 and 4 ranks at 8,192 tokens: the bytes each
    sends per step (counted and on the loopback wire) and every rank's step time."""
    return [_at(8192, cp, cp_attention=variant, cp_balance=balance, repeat=repeat)
            for repeat in range(2) for cp in _degrees()[:2]
            for variant, balance in (("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag"),
                                     ("ulysses", "zigzag"))]


def _balance_records(cp: int, seq_len: int, repeats: int = 3) -> list[dict]:
    """Each rank's share of the causal ring's work, replayed alone in this process (one thread):
    its blocks' kernels, forward and backward, timed (the best of `repeats`), beside the
    schedule's count of them. The ring itself would hide the imbalance: every rank waits at each
    exchange for the slowest, so its step time is the slowest rank's plus waiting."""
    import torch

    from multigpu.models import GPT_SIZES
    from multigpu.strategies import cp_attention as cpa

    config = GPT_SIZES[MODEL]
    heads, head_dim = config.n_head, config.d_model // config.n_head
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for balance in cpa.BALANCES:
            schedule = cpa.ChunkSchedule(cp, balance, causal=True)
            c = seq_len // (cp * cpa.chunks_per_rank(balance))
            gen = torch.Generator().manual_seed(0)
            q, k, v, dout = (torch.randn(1, heads, c, head_dim, generator=gen) for _ in range(4))
            scale = head_dim ** -0.5
            for rank in range(cp):
                blocks = [kind == "diagonal" for s in range(cp) for _, _, kind in schedule.pairs(rank, s)]
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    for diagonal in blocks:
                        out, lse = cpa._block_forward(q, k, v, scale, diagonal)
                        cpa._block_backward(q, k, v, dout, out, lse, scale, diagonal)
                    best = min(best, time.perf_counter() - start)
                rows.append({"balance": balance, "cp": cp, "rank": rank, "seq_len": seq_len, "chunk": c,
                             "blocks": len(blocks), "diagonal_blocks": sum(blocks),
                             "forward_flops": schedule.flops(rank, 1, heads, seq_len, head_dim),
                             "seconds": best})
    finally:
        torch.set_num_threads(threads)
    prov = records.provenance("none", 1, "cpu", 1)
    return [{**row, "provenance": prov} for row in rows]


def cp_balance() -> list[Job]:
    """The causal mask's work on each rank, contiguous chunks against zig-zag: counted from the
    schedule and timed, at 8,192 tokens on 4 and 8 ranks."""
    return [Job(f"ring blocks per rank, cp {cp}", _balance_records, dict(cp=cp, seq_len=8192)) for cp in (4, 8)]


def _longest_records(cp: int, budget: int) -> list[dict]:
    """The longest sequence (a multiple of SEQ_STEP) whose peak on every rank stays within
    `budget`: predicted by the estimator, then measured by running it and the next length up."""
    from multigpu.estimator import peak as est
    from multigpu.estimator.accuracy import setup_of
    from multigpu.launch import launch
    from multigpu.maxbatch import peak_bytes
    from multigpu.models import GPT_SIZES

    prov = records.provenance("gloo" if cp > 1 else "none", cp, "cpu", 1)  # where the runs go

    def on_cpu(seq: int) -> RunConfig:
        return _at(seq, cp).replace(device="cpu", threads_per_worker=1)

    def estimated(seq: int) -> int:
        cfg = on_cpu(seq)
        record = {"config": cfg.to_dict(), "grid": cfg.grid.as_dict(), "provenance": prov}
        return est.estimate(setup_of(record), cfg.global_batch_size).per_rank_bytes["total"]

    first = on_cpu(SEQ_STEP)
    longest = GPT_SIZES[MODEL].seq_len
    setup = setup_of({"config": first.to_dict(), "grid": first.grid.as_dict(), "provenance": prov})
    predicted = est.predict_longest_sequence(setup, first.global_batch_size, budget, SEQ_STEP, longest)
    probes = {}
    for seq in (predicted, predicted + SEQ_STEP):
        if 0 < seq <= longest:
            record = launch(on_cpu(seq).replace(steps=2), progress=False, check_memory=False)
            probes[seq] = {"measured": peak_bytes(record), "estimated": estimated(seq)}
    fits = [s for s, p in probes.items() if p["measured"] <= budget]
    return [{"cp": cp, "budget_bytes": budget, "predicted": predicted, "measured": max(fits, default=None),
             "resolved": predicted + SEQ_STEP in probes and probes[predicted + SEQ_STEP]["measured"] > budget,
             "step": SEQ_STEP, "probes": {str(k): v for k, v in probes.items()}, "provenance": prov}]


def cp_longest() -> list[Job]:
    """The longest sequence a rank's memory takes on one device and on cp ranks: on the CPU, with
    a budget of CPU_BUDGET per rank standing in for a GPU's memory (on a GPU server too: gpt-long's
    16,384 positions fit any GPU, so a GPU's own memory would never decide it)."""
    return [Job(f"longest sequence, cp {cp}", _longest_records, dict(cp=cp, budget=CPU_BUDGET))
            for cp in (1, *_degrees()[:2])]


def ring_timeline(seq_len: int, balance: str, repeats: int = 2) -> dict:
    """Inside a process group of cp ranks: one ring attention layer of gpt-long's shape, forward
    and backward, causal, each ring step's computation timed (cp_attention.EVENTS); the last of
    `repeats` (the first warms up), its events from this rank's start."""
    import torch
    import torch.distributed as dist

    from multigpu.models import GPT_SIZES
    from multigpu.strategies import cp_attention as cpa

    config = GPT_SIZES[MODEL]
    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    shape = (1, config.n_head, seq_len // cp, config.d_model // config.n_head)
    q, k, v, dout = (torch.randn(*shape, generator=gen) for _ in range(4))
    for _ in range(repeats):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        dist.barrier()
        cpa.EVENTS = []
        start_unix, start = time.time(), time.perf_counter()
        try:
            cpa.attention(*leaves, group=dist.group.WORLD, variant="ring", balance=balance, causal=True).backward(dout)
            events = [{**e, "start_s": e["start"] - start, "end_s": e["end"] - start} for e in cpa.EVENTS]
        finally:
            cpa.EVENTS = None
        total = time.perf_counter() - start
    return {"balance": balance, "cp": cp, "seq_len": seq_len, "events": events, "step_start_unix": start_unix,
            "total_s": total}


def _timeline_records(cp: int, seq_len: int) -> list[dict]:
    from multigpu.spmd import run_spmd

    prov = records.provenance("gloo", cp, "cpu", 1)
    out = []
    for balance in ("contiguous", "zigzag"):
        by_rank = run_spmd("multigpu.experiments.context_parallel:ring_timeline", cp, threads=1, seq_len=seq_len,
                           balance=balance)
        out.append({**{k: v for k, v in by_rank[0].items() if k not in ("events", "step_start_unix", "total_s")},
                    "events_by_rank": [r["events"] for r in by_rank],
                    "step_start_unix_by_rank": [r["step_start_unix"] for r in by_rank],
                    "total_s_by_rank": [r["total_s"] for r in by_rank], "provenance": prov})
    return out


def cp_timeline() -> list[Job]:
    """One causal ring attention layer, forward and backward, every rank's computation per ring
    step on a timeline, contiguous chunks and zig-zag: as many ranks as cores, 2 to 4 (one
    thread each, as one GPU a rank; more processes than cores would share them and blur it)."""
    import os

    cp = max(2, min(4, os.cpu_count() or 2))
    return [Job(f"ring timeline, cp {cp}", _timeline_records, dict(cp=cp, seq_len=8192))]
