"""Traces of one training step, for the book's diagrams. Each function runs under
`multigpu.spmd.run_spmd` on gloo processes and returns what its rank saw.

- `zero_holdings`: the from-scratch ZeRO stages (multigpu.strategies.zero), snapshot after
  every event of one step: which elements of the flat model this rank holds as parameters,
  gradients and optimizer state. Drawn by `plots.zero_timeline`.
- `fsdp_collectives`: FSDP2, every collective of one step in the order issued.
- `tp_collectives`: a tensor-parallel strategy, every collective of one step by phase, counted
  and on the loopback wire (experiment "tp_collectives").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from multigpu.config import RunConfig
from multigpu.models import build_model, compute_loss, vocab_size
from multigpu.runtime import RankGrid, Runtime


def _runtime() -> Runtime:
    world = dist.get_world_size()
    return Runtime(dist.get_rank(), dist.get_rank(), world, torch.device("cpu"), "gloo",
                   RankGrid.build("cpu", dp=world))


def _batch(model_name: str, rank: int) -> dict:
    ids = torch.randint(vocab_size(model_name), (2, 16), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": ids}


def zero_holdings(stages=(1, 2, 3), model_name: str = "gpt-tiny", optimizer: str = "adamw",
                  bucket_cap_mb: float = 0.1) -> list[dict]:
    """`zero_holdings_one(stage)` for each stage, in one launch."""
    return [zero_holdings_one(stage, model_name, optimizer, bucket_cap_mb) for stage in stages]


def zero_holdings_one(stage: int, model_name: str = "gpt-tiny", optimizer: str = "adamw",
                      bucket_cap_mb: float = 0.1) -> dict:
    """One step of ZeRO stage 1, 2 or 3, after a first step (so the optimizer state exists).
    Stage 2's buckets are small (`bucket_cap_mb`), so that a small model has several.

    The model axis is the zero's flat groups end to end, padding included. Returns
    {"units": [(name, start, end)], "length", "frames": [{"event", "params", "grads",
    "optimizer"}], ...}: each category a list of [start, end) intervals of the axis that
    this rank holds, with bytes behind them, right after the event."""
    from multigpu.memory import zero_model_states
    from multigpu.strategies.zero import Zero

    rt = _runtime()
    model = build_model(model_name, seed=0)
    cfg = RunConfig(strategy=f"zero{stage}", world_size=rt.world_size, model=model_name, optimizer=optimizer,
                    bucket_cap_mb=bucket_cap_mb)
    zero = Zero(model, cfg, rt, stage)
    unit_of = {id(p): _unit_name(n) for n, p in model.named_parameters()}
    bases = [sum(g.full.numel() for g in zero.groups[:i]) for i in range(len(zero.groups))]

    def holdings() -> dict:
        held = {"params": [], "grads": [], "optimizer": []}
        for g, base in zip(zero.groups, bases):
            whole, mine = [base, base + g.full.numel()], [base + g.lo, base + g.hi]
            if g.full.untyped_storage().nbytes() > 0:  # the whole group is here
                held["params"].append(whole)
            if g.shard.untyped_storage().data_ptr() != g.full.untyped_storage().data_ptr():
                held["params"].append(mine)  # stage 3: the shard has storage of its own
            if stage == 1:  # one flat gradient buffer, the whole model's
                held["grads"].append(whole)
            else:  # shard_grad, and any parameter's full gradient not yet sent
                held["grads"].append(mine)
                held["grads"] += [[base + s, base + s + n] for p, s, n in zip(g.params, g.starts, g.numels)
                                  if p.grad is not None]
                held["grads"] += [[base + b.start, base + b.end] for b in getattr(zero, "buckets", [])
                                  if b.flat is not None]  # stage 2: the bucket being filled
            if zero.optimizer.state.get(g.shard):
                held["optimizer"].append(mine)
        return held

    frames = []

    def snapshot(event: str) -> None:
        if not tracing:
            return
        frame = {"event": event, **holdings()}
        if frames and frames[-1]["event"] == event:  # one frame per event: the one holding most
            if _size(frame) > _size(frames[-1]):
                frames[-1] = frame
        else:
            frames.append(frame)

    for g in zero.groups:  # every gather and reduce-scatter of stage 3 is an event
        def gather(g=g, original=g.gather):
            was_free = g.full.untyped_storage().nbytes() == 0
            original()
            if was_free:
                snapshot(f"all-gather {unit_of[id(g.params[0])]}")

        def reduce_scatter(g=g, original=g.reduce_scatter_grads):
            original()
            snapshot(f"reduce-scatter the gradients of {unit_of[id(g.params[0])]}")
        g.gather, g.reduce_scatter_grads = gather, reduce_scatter

    def send(bucket, original=zero._send_to_owners):  # stage 2: a bucket is full
        snapshot(f"bucket {zero.buckets.index(bucket) + 1} of {len(zero.buckets)} full: "
                 "each piece reduced to its owner")
        original(bucket)
    zero._send_to_owners = send

    batch = _batch(model_name, rt.rank)
    for tracing in (False, True):  # noqa: B007 (snapshot reads it) a warm-up step, then the traced one
        zero.zero_grad()
        snapshot("start of the step")
        loss = compute_loss(model, batch)
        snapshot("forward done")
        loss.backward()
        snapshot("backward done")
        zero.finish_backward()
        if stage == 1:
            snapshot("reduce-scatter the gradients")
        zero.optimizer.step()
        snapshot("optimizer step: each rank updates its shard")
        zero.step()
        snapshot("all-gather the updated parameters" if stage < 3 else "free the gathered parameters")
    units = []
    for g, base in zip(zero.groups, bases):  # the units' spans on the axis, adjacent pieces merged
        for p, start, n in zip(g.params, g.starts, g.numels):
            if units and units[-1][0] == unit_of[id(p)] and units[-1][2] == base + start:
                units[-1] = (unit_of[id(p)], units[-1][1], base + start + n)
            else:
                units.append((unit_of[id(p)], base + start, base + start + n))
    return {"units": units, "length": sum(g.full.numel() for g in zero.groups), "frames": frames,
            "stage": stage, "world_size": rt.world_size, "model": model_name,
            "bytes_per_element": zero_model_states(1, 1, 0, optimizer)}


def held_bytes(trace: dict, k: int) -> dict[str, int]:
    """Bytes this rank holds by category right after event k of a `zero_holdings` trace."""
    held = trace["frames"][k]
    return {cat: per * sum(b - a for a, b in union(held[cat])) for cat, per in trace["bytes_per_element"].items()}


def _size(frame: dict) -> int:
    return sum(b - a for cat in ("params", "grads", "optimizer") for a, b in union(frame[cat]))


def union(spans: list) -> list[tuple[int, int]]:
    """Overlapping [start, end) intervals merged."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _unit_name(parameter_name: str) -> str:
    """"block 2" for the parameters of model.blocks[2]; "the rest" for embeddings, norm, head."""
    parts = parameter_name.split(".")
    return f"block {parts[1]}" if parts[0] == "blocks" else "the rest"


def fsdp_collectives(model_name: str = "gpt-tiny", reshard_after_forward: bool = True) -> list[dict]:
    """One FSDP2 training step, returning every collective in the order issued, with the
    phase it came in (forward, backward, optimizer step)."""
    from multigpu.comm import CommCounter
    from multigpu.strategies.fsdp import prepare

    rt = _runtime()
    model = build_model(model_name, seed=0)
    cfg = RunConfig(strategy="fsdp", world_size=rt.world_size, model=model_name,
                    extra={"reshard_after_forward": reshard_after_forward})
    par = prepare(model, cfg, rt)
    batch = _batch(model_name, rt.rank)
    events = []

    def traced(phase, work):
        with CommCounter(rt.world_size) as comm:
            out = work()
        events.extend({"phase": phase, "collective": kind, "payload_bytes": b} for kind, b in comm.log)
        return out

    loss = traced("forward", lambda: compute_loss(par.module, batch))
    traced("backward", loss.backward)
    traced("optimizer step", par.optimizer.step)
    return events


def tp_collectives(strategy: str = "tp-scratch", model_name: str = "gpt-small", batch: int = 2,
                   seq_len: int = 128, sequence_parallel: bool = False) -> dict:
    """One training step of a tensor-parallel strategy on every rank of the world (tp = N):
    each collective it issues, by phase (forward, backward), counted by CommCounter and
    measured on the loopback wire (all ranks' bytes, this machine's gloo traffic)."""
    from multigpu.comm import CommCounter, loopback_tx_bytes
    from multigpu.strategies import prepare

    n = dist.get_world_size()
    rt = Runtime(dist.get_rank(), dist.get_rank(), n, torch.device("cpu"), "gloo", RankGrid.build("cpu", tp=n))
    cfg = RunConfig(strategy=strategy, world_size=n, model=model_name, global_batch_size=batch, seq_len=seq_len,
                    extra={"sequence_parallel": sequence_parallel}).validate()
    par = prepare(build_model(model_name, seed=0), cfg, rt)
    ids = torch.randint(vocab_size(model_name), (batch, seq_len), generator=torch.Generator().manual_seed(0))
    batch_ = {"input_ids": ids, "labels": ids}  # every TP rank: the same samples
    phases = {}

    def measured(phase, work):
        dist.barrier()
        wire = loopback_tx_bytes()
        dist.barrier()
        with CommCounter(n) as comm:
            out = work()
        dist.barrier()
        after = loopback_tx_bytes()
        phases[phase] = {"calls": dict(comm.calls), "payload_bytes": dict(comm.payload_bytes),
                         "log": comm.log,
                         # the three barriers' own bytes are in it too (a few hundred)
                         "loopback_bytes": None if wire is None else after - wire}
        return out

    for _ in range(2):  # the first step sets things up (DTensor's caches); the second is measured
        phases.clear()
        par.zero_grad()
        loss = measured("forward", lambda: compute_loss(par.module, batch_))
        measured("backward", lambda loss=loss: par.backward(loss))
        par.step()
    return {"strategy": strategy, "tp": n, "sequence_parallel": sequence_parallel, "model": model_name,
            "batch": batch, "seq_len": seq_len, "phases": phases}
