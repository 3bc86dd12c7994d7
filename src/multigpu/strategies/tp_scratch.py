"""Tensor parallelism from scratch, Megatron-style: every rank holds a slice of every layer.

Shoeybi et al. 2019 (Megatron-LM, https://arxiv.org/abs/1909.08053, section 3) cut each pair
of linear layers so that the pair needs no communication in between: the first by its
output features (column-parallel: rank r computes heads r*H/tp ..., or a slice of the MLP's
hidden units), the second by its input features (row-parallel: each rank multiplies its
slice and holds a partial sum of the full output). All the communication happens at the two
ends of such a region, by the operators of `tp_regions.py`: f entering it (identity forward,
all-reduce backward) and g leaving it (all-reduce forward, identity backward); under
sequence parallelism an all-gather of the sequence entering and a reduce-scatter leaving.

Every sharded weight is cut from the full single-device weight, so a run starts exactly
where one device would, and every parameter keeps its single-device name (`state.py`
gathers them whole again).
Layout throughout: [batch, seq, hidden], as in models.py (Megatron's own is [seq, batch, hidden]).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from multigpu.models import GPT, GPT_SIZES, split_problems
from multigpu.strategies import Parallelized, build_optimizer
from multigpu.strategies.state import sliced_state_dict
from multigpu.strategies.tp_regions import f, g, sp_gather, sp_scatter

# -- the layers ------------------------------------------------------------------------------

def _shard(full: torch.Tensor, dim: int, group, parts: int = 1) -> nn.Parameter:
    """This rank's 1/tp of `full` along dim, as a new Parameter that remembers how it was cut.
    parts > 1: `full` is that many tensors laid end to end along dim (a fused [q | k | v]
    projection): the rank takes its 1/tp of each, end to end."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [part.chunk(tp, dim)[rank] for part in full.detach().chunk(parts, dim)]
    param = nn.Parameter(torch.cat(pieces, dim).clone(), requires_grad=full.requires_grad)
    param.tensor_parallel_dim, param.tensor_parallel_parts = dim, parts  # how state.sliced_state_dict puts it back
    param.tensor_parallel_place = (rank, tp)  # and where a checkpoint's piece lies in the whole (state._blocks)
    return param


def _mark_sequence_parallel(*params) -> None:
    """These see only seq/tp positions, so their gradients are partial: sum them over the group."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r. nn.Linear keeps A as (out, in): rank r takes its rows
    [r*out/tp, (r+1)*out/tp), so its output is that slice of the output features. `enter`:
    put the input through f (or the SP all-gather); False when the caller did it already.
    `parts`: the output features are that many projections end to end (attention's fused
    [queries | keys | values]: 3); rank r takes its slice of each, so its output is
    [its queries | its keys | its values], the heads it owns."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool = False, enter: bool = True,
                 parts: int = 1):
        super().__init__()
        self.group, self.sequence_parallel, self.enter = group, sequence_parallel, enter
        self.weight = _shard(linear.weight, 0, group, parts)  # (out/tp, in)
        self.bias = None if linear.bias is None else _shard(linear.bias, 0, group, parts)  # (out/tp,)

    def forward(self, x):  # x: (batch, seq, in), or (batch, seq/tp, in) under SP
        if self.enter:  # f, or under SP the all-gather of the sequence
            x = sp_gather(x, self.group) if self.sequence_parallel else f(x, self.group)
        return F.linear(x, self.weight, self.bias)  # (batch, seq, out/tp): stays split


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r + b. Rank r takes columns [r*in/tp, (r+1)*in/tp) of the (out, in)
    weight and multiplies its slice of the input features: a partial sum of the output. The
    bias is added once, after the reduction (added before it, it would count tp times)."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(linear.weight, 1, group)  # (out, in/tp)
        self.bias = linear.bias  # (out,): whole on every rank
        if sequence_parallel:
            _mark_sequence_parallel(self.bias)  # added to this rank's positions only

    def forward(self, x):  # x: (batch, seq, in/tp)
        y = F.linear(x, self.weight)  # this rank's partial sum
        # g, or under SP the reduce-scatter of the sequence
        y = sp_scatter(y, self.group) if self.sequence_parallel else g(y, self.group)
        return y if self.bias is None else y + self.bias  # (batch, seq or seq/tp, out)


class VocabParallelEmbedding(nn.Module):
    """Rank r owns the vocabulary rows [r*V/tp, (r+1)*V/tp). Each rank looks up the ids it
    owns and writes zeros for the others; the sum over ranks (g, or the SP reduce-scatter)
    is then the full embedding."""

    def __init__(self, embedding: nn.Embedding, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(embedding.weight, 0, group)  # (V/tp, d)
        self.start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, ids):  # ids: (batch, seq) global token ids
        elsewhere = (ids < self.start) | (ids >= self.start + self.weight.shape[0])
        local = (ids - self.start).masked_fill(elsewhere, 0)
        out = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        # the sum over ranks, g (or the SP reduce-scatter): (batch, seq or seq/tp, d)
        return sp_scatter(out, self.group) if self.sequence_parallel else g(out, self.group)


class SequenceShardedPositions(nn.Module):
    """Under SP the residual stream holds positions [r*T/tp, (r+1)*T/tp): look up only those.
    The table stays whole (same Parameter), but each rank's gradient covers its rows only."""

    def __init__(self, wpe: nn.Embedding, group):
        super().__init__()
        self.group, self.weight = group, wpe.weight
        _mark_sequence_parallel(self.weight)

    def forward(self, pos):  # pos: (seq,) -> (seq/tp, d)
        n = pos.shape[0] // dist.get_world_size(self.group)
        return F.embedding(pos[dist.get_rank(self.group) * n:][:n], self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy from logits cut by vocabulary: three all-reduces of one number per token
    (max, target logit, sum of exponentials) instead of gathering (tokens, V) logits."""

    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index):  # logits: (N, V/tp) fp32; labels: (N,)
        n_local = logits.shape[-1]
        start = dist.get_rank(group) * n_local
        top = logits.max(dim=-1).values  # 1. the global max, so that exp() cannot overflow
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        mine = (labels >= start) & (labels < start + n_local)  # 2. the target's logit: one rank has it
        local = (labels - start).clamp(0, n_local - 1)
        target = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target, group=group)
        exp = shifted.exp()  # 3. the softmax denominator
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        valid = labels != ignore_index
        count = valid.sum()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine & valid, valid, count)
        return torch.where(valid, sum_exp.log() - target, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad_loss):  # d(mean loss)/d(logits) = (softmax - onehot) / tokens
        softmax, local, hit, valid, count = ctx.saved_tensors
        grad = softmax * valid.unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1).to(grad.dtype))
        return grad * (grad_loss / count), None, None, None


def vocab_parallel_cross_entropy(local_logits, labels, group, ignore_index: int = -100):
    """Mean cross-entropy over every label token, equal to F.cross_entropy on the full logits;
    local_logits: (..., V/tp), this rank's vocabulary slice; labels: (...) global ids. fp32."""
    return _VocabParallelCrossEntropy.apply(
        local_logits.flatten(0, -2).float(), labels.flatten(), group, ignore_index)


# -- the model -------------------------------------------------------------------------------

def check_divisible(cfg, tp: int) -> None:
    """Raise ValueError unless tp splits the heads, the MLP's hidden units and the vocabulary."""
    name = next((n for n, c in GPT_SIZES.items() if c == cfg), "this model")
    for count, what in ((cfg.n_head, "attention heads"), (cfg.d_ff, "MLP hidden units"),
                        (cfg.vocab_size, "vocabulary entries")):
        for problem in split_problems(tp, count, f"{what} of {name}"):
            raise ValueError(problem)


class TensorParallelLM(nn.Module):
    """The GPT with its layers swapped, and the loss computed on vocabulary-sharded logits."""

    def __init__(self, model: GPT, group, sequence_parallel: bool):
        super().__init__()
        self.model, self.group, self.sequence_parallel = model, group, sequence_parallel

    def forward(self, input_ids, labels=None):  # input_ids: (batch, seq), the same on every TP rank
        tp = dist.get_world_size(self.group)
        if self.sequence_parallel and input_ids.shape[1] % tp:
            raise ValueError(f"sequence parallelism splits the sequence over tp {tp} ranks, but the "
                             f"sequence has {input_ids.shape[1]} tokens; use a length divisible by {tp}")
        logits = self.model(input_ids)  # (batch, seq, vocab/tp): this rank's slice of the vocabulary
        return logits if labels is None else vocab_parallel_cross_entropy(logits, labels, self.group)


def parallelize(model: GPT, group, sequence_parallel: bool = False) -> TensorParallelLM:
    """Swap the GPT's layers, in place, for their tensor-parallel versions over `group`."""
    if not isinstance(model, GPT):
        raise ValueError(f"tp-scratch splits the GPT presets only, not {type(model).__name__}")
    check_divisible(model.cfg, dist.get_world_size(group))
    sp = sequence_parallel
    for block in model.blocks.values():
        block = getattr(block, "_checkpoint_wrapped_module", block)  # under activation checkpointing
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear(attn.qkv, group, sp, parts=3)  # this rank's heads of q, k and v
        attn.proj = RowParallelLinear(attn.proj, group, sp)
        mlp.fc = ColumnParallelLinear(mlp.fc, group, sp)
        mlp.proj = RowParallelLinear(mlp.proj, group, sp)
        if sp:
            _mark_sequence_parallel(*block.ln_1.parameters(), *block.ln_2.parameters())
    tied = model.lm_head.weight is model.wte.weight
    model.wte = VocabParallelEmbedding(model.wte, group, sp)
    head = ColumnParallelLinear(model.lm_head, group, sp)  # logits stay cut by vocabulary
    if tied:  # the head's rows and the embedding's rows are the same tokens: one Parameter
        head.weight = model.wte.weight
    model.lm_head = head
    if sp:
        model.wpe = SequenceShardedPositions(model.wpe, group)
        _mark_sequence_parallel(*model.ln_f.parameters())
    return TensorParallelLM(model, group, sp)


def sync_sequence_parallel_grads(model: nn.Module, group) -> None:
    """Sum over the group the gradients of parameters that saw only a slice of the sequence
    (LayerNorms, positions, row-parallel biases), in one all-reduce of a flat buffer."""
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(summed.view_as(grad))


def config_problems(cfg) -> list[str]:
    """What RunConfig.validate reports before any process starts."""
    from multigpu.models import family

    if family(cfg.model) != "gpt":
        return [f"it splits the package's GPT (gpt-* presets, gpt2 config files), not {cfg.model}; "
                "use --strategy tp for a Hugging Face model"]
    return []


def prepare(model, cfg, rt) -> Parallelized:
    # a tp-only grid: RunConfig.validate refuses a dp or pp (the strategy table's `combines`)
    group = rt.grid.group("tp")
    sp = bool(cfg.extra.get("sequence_parallel", False))
    module = parallelize(model, group, sp)
    optimizer = build_optimizer(model.parameters(), cfg)  # this rank's shards (a tied weight once)

    def step():
        if sp:
            sync_sequence_parallel_grads(model, group)
        optimizer.step()

    return Parallelized(module=module, optimizer=optimizer, model=model, step=step,
                        gather_state_dict=partial(sliced_state_dict, model, group),
                        checkpoint_names="local")  # slices as plain tensors: each rank's under its keys
