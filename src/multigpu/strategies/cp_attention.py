"""Attention over a sequence cut across the ranks of a context-parallel group, from scratch.

Context parallelism gives each of cp ranks a part of every sequence. Everything in a
transformer but attention works token by token, so it runs on the part as it is; attention
needs every query to meet every key (every earlier key, under the causal mask). Three ways to
make it meet them, each an `attention(q, k, v, ...)` that returns this rank's part of the
output and whose backward returns this rank's part of the gradients:

- **ring** (Liu et al. 2023, Ring Attention, https://arxiv.org/abs/2310.01889): the keys and
  values travel round the ring of ranks, one neighbour's at a time (`batch_isend_irecv`), while
  this rank computes with the ones it holds. The partial results are merged with the online
  softmax (Milakov and Gimelshein 2018; FlashAttention's rescaling): a running log-sum-exp
  per query row. Backward is a second ring: the keys and values go round again, and with them
  the gradients of the keys and values, which come home summed over every rank.
- **allgather**: every rank gathers all keys and values (`all_gather_into_tensor`), computes
  its queries against them, and sends the gradients back with a reduce-scatter (Llama 3's
  choice for its long-context training; PyTorch's "allgather" rotate method).
- **ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509): an
  all-to-all turns "my tokens, all heads" into "all tokens, my heads"; plain attention runs on
  the whole sequence for cp-th of the heads; a second all-to-all turns it back. Needs the heads
  to split over cp.

Which tokens a rank holds is its **layout** (cp_layout: contiguous or zig-zag chunks). Under the
causal mask a query meets only earlier keys, so with contiguous chunks the last rank has cp
times the first one's work; zig-zag pairs an early chunk with a late one and every rank gets
the same (`cp_layout.ChunkSchedule` counts it).

Everything here runs on any device and any backend with point-to-point and all-to-all (gloo,
NCCL).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from multigpu.strategies.cp_layout import (  # noqa: F401 - the layout's names, where callers find them
    BALANCES,
    VARIANTS,
    ChunkSchedule,
    chunks_per_rank,
    layout,
    positions,
    sent_bytes_per_layer,
    sequence_problem,
    split_sequence,
)

# -- one block of scores, and the online softmax that merges blocks ------------------------

def _scores(q, k, scale, diagonal: bool):
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:  # a query sees keys up to its own position in the same chunk
        n = s.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _block_forward_math(q, k, v, scale, diagonal):
    """Softmax attention of queries q over keys k alone: (output, log-sum-exp per query row)."""
    s = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _merge(out, lse, block_out, block_lse):
    """The online softmax: two partial attentions over disjoint keys, each normalised by its own
    sum of exponentials (their log-sum-exps lse), combined into the attention over both keys."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)), new


def _block_backward_math(q, k, v, dout, out, lse, scale, diagonal):
    """Gradients of one block given the final log-sum-exp of each query row (so the block's
    probabilities are exp(scores - lse), the whole softmax's) and the final output (through
    delta = rowsum(dout * out), the softmax's own term)."""
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


# The same two functions as one fused kernel each, where PyTorch has one that returns the
# log-sum-exp and takes it back: the CPU's flash attention, CUDA's memory-efficient attention
# (the kernels PyTorch's own context_parallel calls on CUDA). They never hold a block's c x c
# scores, and they are several times faster; the tests hold them to the arithmetic above (on
# an H200, torch 2.11: float32 within 4e-6; in bfloat16 the memory-efficient backward given
# another output's log-sum-exp came out wrong, NaN in the ring, so half precision on CUDA takes
# the arithmetic, in float32).
def _fused(q) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)) or (
        q.device.type == "cuda" and q.dtype == torch.float32)


def _block_forward(q, k, v, scale, diagonal):
    if not _fused(q):
        out, lse = _block_forward_math(q.float(), k.float(), v.float(), scale, diagonal)
        return out.to(q.dtype), lse
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diagonal, scale=scale)
    if q.device.type == "cuda":
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, diagonal,
                                                                               scale=scale)
        return out, lse[..., :q.shape[-2]].float()  # (its log-sum-exp comes padded to a multiple of 32 rows)
    raise AssertionError(f"no fused kernel on {q.device.type}")  # _fused admits only the two above


def _block_backward(q, k, v, dout, out, lse, scale, diagonal):
    if not _fused(q):
        grads = _block_backward_math(q.float(), k.float(), v.float(), dout.float(), out.float(), lse, scale, diagonal)
        return tuple(g.to(q.dtype) for g in grads)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, diagonal, scale=scale)
    if q.device.type == "cuda":
        rows = q.shape[-2]
        padded = F.pad(lse, (0, -rows % 32)).contiguous()
        none = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: no random state
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, none, none, 0.0, [True, True, True, False], diagonal, scale=scale)
        return dq, dk, dv
    raise AssertionError(f"no fused kernel on {q.device.type}")  # _fused admits only the two above


def _tokens_major(x):
    """x (batch, heads, tokens, d) stored token by token, as PyTorch's fused attention stores its
    output: the model's `transpose(1, 2).reshape` is then a view, and the output projection saves
    the same storage backward keeps, not a copy of it."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _chunks(x, n, dim=-2):
    """x's n chunks along dim (a rank's layout chunks), each contiguous, as the kernels take them."""
    return [c.contiguous() for c in x.chunk(n, dim=dim)]


# -- ring ----------------------------------------------------------------------------------

# None, or a list the ring appends each step's computation to, {"action": "F" (forward) or "B"
# (backward), "micro": whose keys and values, "start"/"end": time.perf_counter()}: the chapter's
# timeline of one ring (experiments.context_parallel.ring_timeline); the gaps are the waits
EVENTS: list[dict] | None = None


@contextmanager
def _recorded(action: str, source: int):
    if EVENTS is None:
        yield
        return
    start = time.perf_counter()
    yield
    EVENTS.append({"action": action, "stage": 0, "micro": source, "start": start, "end": time.perf_counter()})


class _PostOrder:
    """The order backward posts its two rings' messages in, checked at each post: keys and values
    (tag 0) and their gradients' shares (tag 1) alternate, KV first, and the last share goes alone.
    The tags keep the rings apart on backends that match messages by tag (gloo); NCCL matches them
    by order, and the two rings' tensors have one shape, so there only this order, the same on every
    rank, keeps a rank from receiving gradients as keys: a change that made it depend on the rank
    would give wrong results without an error."""

    def __init__(self, cp: int):
        self.expected, self.posted = [0, 1] * (cp - 1) + [1], []

    def __call__(self, tag: int) -> int:
        self.posted.append(tag)
        if self.posted != self.expected[:len(self.posted)]:
            raise RuntimeError(f"ring attention's backward posted its messages as {self.posted} (0: keys and "
                               f"values, 1: their gradients); NCCL pairs them by order, which must be "
                               f"{self.expected} on every rank")
        return tag


def _exchange(send: torch.Tensor, group, tag: int):
    """Send `send` to the next rank of the ring and receive the previous rank's into a new
    tensor; returns (work handles, the receive buffer). The tag keeps backward's two rings apart
    on gloo; on NCCL their order does (_PostOrder)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:  # a ring of one: the message is home already (gloo cannot send to itself)
        return [], send
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prev = dist.get_global_rank(group, (rank - 1) % cp)
    recv = torch.empty_like(send)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group, tag),
                                    dist.P2POp(dist.irecv, recv, prev, group, tag)])
    return works, recv


def _wait(works):
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """q, k, v: (batch, heads, this rank's tokens, head_dim), the rank's chunks side by side."""

    @staticmethod
    def forward(ctx, q, k, v, group, schedule: ChunkSchedule):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        n = chunks_per_rank(schedule.balance)
        scale = 1 / math.sqrt(q.shape[-1])
        qs = _chunks(q, n)
        outs, lses = [None] * n, [None] * n
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            source = (rank - step) % cp  # whose keys and values this rank holds now
            if step < cp - 1:  # pass them on while computing with them
                works, incoming = _exchange(kv, group, tag=0)
            ks, vs = _chunks(kv[0], n), _chunks(kv[1], n)
            with _recorded("F", source):
                for i, j, kind in schedule.pairs(rank, source):
                    o, lse = _block_forward(qs[i], ks[j], vs[j], scale, kind == "diagonal")
                    outs[i], lses[i] = _merge(outs[i], lses[i], o, lse)
            if step < cp - 1:
                _wait(works)
                kv = incoming
        out, lse = _tokens_major(torch.cat(outs, dim=-2).to(q.dtype)), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.schedule = group, schedule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, schedule = ctx.group, ctx.schedule
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        n = chunks_per_rank(schedule.balance)
        scale = 1 / math.sqrt(q.shape[-1])
        qs, douts, outs, lses = _chunks(q, n), _chunks(dout.to(q.dtype), n), _chunks(out, n), _chunks(lse, n, -1)
        dqs = [torch.zeros_like(c) for c in qs]
        kv = torch.stack([k, v]).contiguous()
        dkv_works, dkv = None, None
        order = _PostOrder(cp)
        for step in range(cp):
            source = (rank - step) % cp
            if step < cp - 1:
                works, incoming = _exchange(kv, group, tag=order(0))
            ks, vs = _chunks(kv[0], n), _chunks(kv[1], n)
            part = torch.zeros_like(kv)  # this rank's share of source's key and value gradients
            dks, dvs = part[0].chunk(n, dim=-2), part[1].chunk(n, dim=-2)  # views: += fills part
            with _recorded("B", source):
                for i, j, kind in schedule.pairs(rank, source):
                    dq, dk, dv = _block_backward(qs[i], ks[j], vs[j], douts[i], outs[i], lses[i], scale,
                                                 kind == "diagonal")
                    dqs[i] += dq
                    dks[j].add_(dk)
                    dvs[j].add_(dv)
            if dkv_works is not None:  # the shares of the ranks before, for the same source
                _wait(dkv_works)
                part += dkv
            dkv_works, dkv = _exchange(part, group, tag=order(1))  # on to the next rank; home after cp sends
            if step < cp - 1:
                _wait(works)
                kv = incoming
        _wait(dkv_works)
        return torch.cat(dqs, dim=-2), dkv[0], dkv[1], None, None


# -- all-gather ----------------------------------------------------------------------------

class _GatherSequence(torch.autograd.Function):
    """All ranks' x, stacked on a new first dimension (cp, ...); backward: each rank's gradient
    summed over the ranks that used it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        cp = dist.get_world_size(group)
        out = torch.empty((cp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)  # the ranks' x end to end along dim 0
        return out.view(cp, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        mine = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(mine, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        return mine, None


def _causal_mask(q_pos, k_pos):
    return q_pos.unsqueeze(-1) >= k_pos.unsqueeze(0)


def allgather_attention(q, k, v, group, schedule: ChunkSchedule):
    """This rank's queries against every rank's keys and values, gathered, masked by position."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = _GatherSequence.apply(torch.stack([k, v]), group)  # (cp, 2, batch, heads, tokens, head_dim)
    k_all = torch.cat(list(kv[:, 0]), dim=-2)
    v_all = torch.cat(list(kv[:, 1]), dim=-2)
    mask = None
    if schedule.causal:
        seq_len = q.shape[-2] * cp
        q_pos = positions(seq_len, cp, rank, schedule.balance, q.device)
        k_pos = torch.cat([positions(seq_len, cp, r, schedule.balance, q.device) for r in range(cp)])
        mask = _causal_mask(q_pos, k_pos)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


# -- Ulysses -------------------------------------------------------------------------------

def _all_to_all(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)  # (after contiguous: empty_like keeps a transposed tensor's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def _tokens_to_heads(x, cp, group):
    """(batch, heads, my tokens, d) -> (batch, heads / cp, every rank's tokens, d), ranks in order."""
    b, h, t, d = x.shape
    x = x.reshape(b, cp, h // cp, t, d).transpose(0, 1)  # (cp: whose heads, batch, heads/cp, t, d)
    x = _all_to_all(x, group)  # now (cp: whose tokens, batch, my heads, t, d)
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_tokens(x, cp, group):
    """The inverse of _tokens_to_heads."""
    b, hc, ct, d = x.shape
    x = x.reshape(b, hc, cp, ct // cp, d).permute(2, 0, 1, 3, 4)  # (cp: whose tokens, batch, my heads, t, d)
    x = _all_to_all(x, group)  # (cp: whose heads, batch, heads/cp, my t, d)
    return x.transpose(0, 1).reshape(b, cp * hc, ct // cp, d)


class _Reshard(torch.autograd.Function):
    """One of the two all-to-alls (`there`), whose gradient goes back through the other (`back`)."""

    @staticmethod
    def forward(ctx, x, cp, group, there, back):
        ctx.cp, ctx.group, ctx.back = cp, group, back
        return there(x, cp, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.cp, ctx.group), None, None, None, None


def ulysses_attention(q, k, v, group, schedule: ChunkSchedule):
    """All-to-all to whole sequences of cp-th of the heads, plain attention, all-to-all back. The
    gathered tokens come in the ranks' layout order; they are put in sequence order for the
    causal mask and back after."""
    cp = dist.get_world_size(group)
    q, k, v = (_Reshard.apply(t, cp, group, _tokens_to_heads, _heads_to_tokens) for t in (q, k, v))
    seq_len = q.shape[-2]
    order = torch.cat([positions(seq_len, cp, r, schedule.balance, q.device) for r in range(cp)])
    unsort = torch.argsort(order)  # gathered index of the token at each sequence position
    q, k, v = (t.index_select(-2, unsort) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=schedule.causal)
    return _tokens_major(_Reshard.apply(y.index_select(-2, order), cp, group, _heads_to_tokens, _tokens_to_heads))


# -- the one entry point -------------------------------------------------------------------

def attention(q, k, v, *, group, variant: str = "ring", balance: str = "zigzag", causal: bool = True):
    """Attention of this rank's queries over the whole sequence, held in parts by the ranks of
    `group`. q, k, v: (batch, heads, this rank's tokens, head_dim), in the rank's layout."""
    schedule = ChunkSchedule(dist.get_world_size(group), balance, causal)
    if variant == "ring":
        return RingAttention.apply(q, k, v, group, schedule)
    if variant == "allgather":
        return allgather_attention(q, k, v, group, schedule)
    if variant == "ulysses":
        return ulysses_attention(q, k, v, group, schedule)
    raise ValueError(f"unknown context-parallel attention {variant!r}; choose one of: {', '.join(VARIANTS)}")
