"""Context parallelism from scratch: every sequence cut across the ranks of a cp group.

Past a few thousand tokens a transformer's activations are dominated by the sequence: each
layer keeps (batch x sequence x width) values, and attention's scores grow with the square of
the sequence. Tensor, pipeline and data parallelism cut the model or the batch, never the
sequence. Context parallelism gives each of cp ranks its part of every sequence
(`cp_attention.layout`): every layer but attention works token by token and runs on the part
unchanged; attention, which must let each query meet the keys of the whole sequence, is
swapped for one of `cp_attention`'s (ring, all-gather or Ulysses).

Each cp rank holds the whole model, sees the same samples as the other ranks of its group (they
share one data-parallel rank), and computes the mean loss over its own tokens. Every rank holds
the same number of tokens, so the mean of those means is the loss over the whole sequences, and
the mean of the ranks' gradients its gradient: the gradients are averaged over the ranks that
share the model, the cp ranks and the dp ranks together (`GradBuckets`, overlapped with
backward as in ddp-scratch). The loss each rank reports is the whole sequences' (one scalar
all-reduce over the cp group); its gradient is the rank's own.

`cp-scratch --world-size 4` is cp 4; `--cp 2 --world-size 4` is dp 2 x cp 2. `fsdp --cp 2` shards
the model over the dp x cp ranks instead, with `--tp N` inside, and a library pipeline (`pp-1f1b
--cp 2`, ...) runs a cp line in every stage (compose.py gives the order). Options (RunConfig.extra, any strategy
with cp > 1): `cp_attention` ring (default), allgather or ulysses; `cp_balance` zigzag (default)
or contiguous. The package's GPT only: its attention is the one that can be swapped, and its
positions are a table indexed by position (a Hugging Face model's own attention and rotary
positions would need their own plumbing).
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch import nn

from multigpu.strategies import Parallelized
from multigpu.strategies import cp_attention as cpa


def options(cfg) -> tuple[str, str]:
    """(attention variant, balance) a run asks for."""
    extra = cfg.extra or {}
    return extra.get("cp_attention", "ring"), extra.get("cp_balance", "zigzag")


def context_problems(cfg) -> list[str]:
    """What makes context parallelism impossible for `cfg`, before any process starts (every
    strategy with cp > 1, and the cp options given without it)."""
    from multigpu.models import _config_sizes, default_seq_len, family

    variant, balance = options(cfg)
    cp = cfg.degrees.get("cp", 1)
    asked = [k for k in ("cp_attention", "cp_balance") if k in (cfg.extra or {})]
    if cp == 1:
        flags = " and ".join("--" + k.replace("_", "-") for k in asked)
        verb = "chooses" if len(asked) == 1 else "choose"
        return [f"{flags} {verb} how context parallelism cuts the sequence; this run has cp 1: give "
                "--cp N (or --strategy cp-scratch), or leave them out"] if asked else []
    problems = []
    if variant not in cpa.VARIANTS:
        problems.append(f"cp_attention {variant!r} is not one of: {', '.join(cpa.VARIANTS)}")
    if balance not in cpa.BALANCES:
        problems.append(f"cp_balance {balance!r} is not one of: {', '.join(cpa.BALANCES)}")
    if problems:
        return problems
    if family(cfg.model) != "gpt":
        return [f"context parallelism swaps the attention of the package's GPT (a gpt-* preset or a gpt2 "
                f"config.json), not {cfg.model!r}'s"]
    seq_len = cfg.seq_len or default_seq_len(cfg.model)
    problem = cpa.sequence_problem(seq_len, cp, balance)
    if problem:
        problems.append(problem)
    heads = _config_sizes(cfg.model)["heads"] // cfg.degrees["tp"]
    if variant == "ulysses" and heads % cp:
        problems.append(f"Ulysses gives each of the cp={cp} ranks whole heads, and a rank has {heads} "
                        f"head(s){' (after tp ' + str(cfg.degrees['tp']) + ')' if cfg.degrees['tp'] > 1 else ''}: "
                        f"use a cp that divides {heads}, or cp_attention ring or allgather")
    tp = cfg.degrees["tp"]
    if tp > 1 and (cfg.extra or {}).get("sequence_parallel") and (seq_len // cp) % tp:
        problems.append(f"sequence parallelism cuts each cp rank's {seq_len // cp} tokens over the tp={tp} ranks: use "
                        f"a sequence length that is a multiple of {cp * tp}")
    if (cfg.extra or {}).get("replicas", 1) != 1:
        problems.append("context parallelism with hybrid sharding (--hsdp-replicas) is not built: use plain fsdp --cp")
    return problems


def context_group(grid):
    """A process group of this rank's cp line, its own: the ring's messages and the loss's
    all-reduce never share a group with gradient collectives running beside them. Every rank
    makes every line's group, in the same order (new_group is collective), once per grid (a
    pipeline rank's stages share it)."""
    if "cp-ring" in grid._groups:
        return grid._groups["cp-ring"]
    mine = None
    world = grid.size("pp") * grid.size("dp") * grid.size("cp") * grid.size("tp")
    lines: dict[tuple, list[int]] = {}
    from multigpu.runtime import RankGrid

    for rank in range(world):
        at = RankGrid(grid.sizes, rank)
        key = tuple(at.coord(d) for d in ("pp", "dp", "tp"))
        lines.setdefault(key, []).append(rank)
    for ranks in lines.values():
        group = dist.new_group(ranks)
        if grid.rank in ranks:
            mine = group
    grid._groups["cp-ring"] = mine
    return mine


class ContextParallel(nn.Module):
    """forward(input_ids, labels): the whole sequences in; this rank's part of them (its tokens
    and their positions) through the model; the loss over every part out, its gradient this
    rank's part's (the gradients are averaged over the ranks afterwards). Given position_ids,
    the batch is this rank's part already (PyTorch's context_parallel cut it in place).
    `inner`: what computes the loss of the part (default the model; under tensor parallelism
    tp_plan's LossModule, whose loss-parallel context `backward` then enters)."""

    def __init__(self, model: nn.Module, group, balance: str, inner: nn.Module | None = None):
        super().__init__()
        self.model = model
        object.__setattr__(self, "inner", model if inner is None else inner)  # not a second copy in the state
        self.group, self.balance = group, balance
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def forward(self, input_ids, labels=None, position_ids=None):
        if position_ids is None:
            seq_len = input_ids.shape[1]
            if seq_len > self.model.cfg.seq_len:
                raise ValueError(f"sequence of {seq_len} tokens is longer than the model's {self.model.cfg.seq_len}")
            mine = partial(cpa.split_sequence, dim=1, cp=self.cp, rank=self.rank, balance=self.balance)
            position_ids = cpa.positions(seq_len, self.cp, self.rank, self.balance, input_ids.device)
            input_ids, labels = mine(input_ids), None if labels is None else mine(labels)
        if labels is None:  # this rank's tokens' logits
            return self.inner(input_ids=input_ids, position_ids=position_ids)
        loss = self.inner(input_ids=input_ids, labels=labels, position_ids=position_ids)
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=self.group)
        return loss + (whole / self.cp - loss.detach())  # the value: the whole loss; the gradient: this rank's

    def backward(self, loss) -> None:
        """The loss's backward, inside what `inner` needs around it (tensor parallelism's loss_parallel)."""
        inner_backward = getattr(self.inner, "backward", None)
        if inner_backward is not None:
            inner_backward(loss)
        else:
            loss.backward()


def parallelize(model: nn.Module, cfg, grid, inner: nn.Module | None = None) -> ContextParallel:
    """Swap every attention of `model` (the package's GPT) for the context-parallel one over this
    rank's cp line, in place; return the module that cuts each batch's sequences (and hands them to
    `inner`, the model by default). Under tensor parallelism each rank's attention holds its heads
    only, whole for its part of the sequence (sequence parallelism gathers it before the products):
    the ring runs per head, so it runs on the rank's heads unchanged."""
    group, balance = swap_attention(model, cfg, grid), options(cfg)[1]
    return ContextParallel(model, group, balance, inner)


def swap_attention(model: nn.Module, cfg, grid):
    """Every attention of `model` (the package's GPT, or a pipeline stage's piece of it) swapped for the
    context-parallel one over this rank's cp line, in place; returns the line's group. A pipeline
    stage takes its part of the sequence from the schedule (pp.py cuts each batch before its step)."""
    from multigpu.models import CausalSelfAttention

    variant, balance = options(cfg)
    group = context_group(grid)
    for attention in (m for m in model.modules() if isinstance(m, CausalSelfAttention)):
        attention.attend = partial(cpa.attention, group=group, variant=variant, balance=balance, causal=True)
    return group


def replicas(model, module, cfg, **calls) -> Parallelized:
    """`module` (the model, its sequences cut) trained as ddp-scratch trains replicas, over every
    rank: each holds the whole model, dp x cp replicas of it. `calls`: more of Parallelized's."""
    from multigpu.strategies.ddp_scratch import replicated

    return replicated(model, module, cfg, dist.group.WORLD, **calls)


def prepare(model, cfg, rt) -> Parallelized:
    variant, balance = options(cfg)
    return replicas(model, parallelize(model, cfg, rt.grid), cfg,
                    report=lambda: {"cp_attention": variant, "cp_balance": balance})
