"""The communication of tensor parallelism from scratch: where a parallel region begins and ends.

Megatron-LM (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053, section 3) cuts each
pair of linear layers so that the pair needs no communication in between (`tp_scratch.py`).
Two conjugate operators carry all the communication, one at each end of such a region:

    f: identity in forward, all-reduce in backward.  Entering: every rank feeds the same X
       to its slice, so X's gradient is the sum of every slice's contribution.
    g: all-reduce in forward, identity in backward.  Leaving: the partial sums are added;
       the gradient of a sum reaches every addend unchanged.

The backward swaps them because they are each other's transpose: "copy X to N ranks" and
"sum N tensors" are adjoint linear maps. So a block costs two all-reduces in forward (g after
attention and after the MLP) and two in backward (f before them).

Sequence parallelism (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198) splits g's
all-reduce into its two halves: leave a region with a reduce-scatter along the sequence (each
rank keeps seq/tp positions of the sum), enter the next with an all-gather. In between
(LayerNorms, residual adds) each rank computes and stores only its share of the sequence,
for the same bytes on the wire. Again the backward swaps them: all-gather <-> reduce-scatter.
(That paper reuses the letters: its g is our `sp_gather`, its g-bar our `sp_scatter`.)

picotron keeps these apart from the layers too (huggingface/picotron, tp_communications.py),
as Megatron-LM does (megatron/core/tensor_parallel/mappings.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ = 1  # the sequence dimension of [batch, seq, hidden]


# -- two collectives along any dim, and an all-reduce that leaves its input alone --------------
# gloo wants contiguous tensors: we send a contiguous copy, never a view or autograd's own grad.

def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's x, concatenated along dim (all_gather_single concatenates along dim 0)."""
    x = x.transpose(0, dim).contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=group)
    return out.transpose(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The sum of x over ranks, of which this rank keeps its 1/tp along dim."""
    x = x.transpose(0, dim).contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_single(out, x, group=group)
    return out.transpose(0, dim).contiguous()


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()  # a fresh tensor: x may be an input, or a grad another node shares
    dist.all_reduce(x, group=group)
    return x


# -- the four conjugate operators ---------------------------------------------------------------

class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (Megatron's _CopyToModelParallelRegion)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (Megatron's _ReduceFromModelParallelRegion)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Enter a region under SP: all-gather the sequence forward, reduce-scatter it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, SEQ, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Leave a region under SP: reduce-scatter the sequence forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, SEQ, ctx.group), None


def f(x, group):
    return CopyToParallelRegion.apply(x, group)


def g(x, group):
    return ReduceFromParallelRegion.apply(x, group)


def sp_gather(x, group):
    return GatherFromSequenceParallelRegion.apply(x, group)


def sp_scatter(x, group):
    return ReduceScatterToSequenceParallelRegion.apply(x, group)
