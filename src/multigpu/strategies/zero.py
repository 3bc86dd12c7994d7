"""ZeRO from scratch: stages 1, 2 and 3 (Rajbhandari et al., SC 2020,
https://arxiv.org/abs/1910.02054).

Data parallelism keeps N copies of everything. ZeRO cuts the redundant copies into N shards,
one per rank, and communicates to make up for what a rank no longer holds:

- stage 1 (P_os): rank r keeps the optimizer state of shard r only. After backward the
  gradients are reduce-scattered (rank r receives the sum for shard r), rank r updates shard
  r, and the updated shards are all-gathered so that every rank has the whole model again.
- stage 2 (P_os+g): as stage 1, but gradients leave as backward produces them: each goes
  into a bucket and is dropped, and a full bucket's pieces are reduced to the ranks that
  own them: rank r keeps only shard r's gradients, plus the bucket being filled.
- stage 3 (P_os+g+p): parameters are sharded too. A unit (one transformer block, or the
  rest of the model) is all-gathered just before its forward and freed after it, gathered
  again just before its backward, and its gradients are reduce-scattered and freed after.

The bookkeeping is `FlatShards`: a group of parameters laid end to end in one flat buffer,
padded to a multiple of N, so that rank r owns elements [r*S, (r+1)*S) and every shard has
the same size S. The model's parameters become views into that buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from multigpu.config import ZERO_STAGE
from multigpu.models import transformer_blocks
from multigpu.strategies import Parallelized, build_optimizer


class FlatShards:
    """`params` end to end in `self.full` (N equal shards); `self.shard` is rank r's piece."""

    def __init__(self, params: list[nn.Parameter], group, sharded_storage: bool):
        if not params:
            raise ValueError("a flat group needs at least one parameter")
        self.params, self.group = params, group
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        # stage 3's bookkeeping: gathered for backward, how many gradients have arrived
        self.in_backward, self.awaiting_backward, self.grads_ready = False, False, 0
        self.numels = [p.numel() for p in params]
        self.shapes = [tuple(p.shape) for p in params]
        self.starts = [sum(self.numels[:i]) for i in range(len(params))]
        total = sum(self.numels)
        self.size = math.ceil(total / world_size)  # S: elements per shard
        self.lo, self.hi = rank * self.size, (rank + 1) * self.size  # this rank's shard
        p0 = params[0]
        self.full = torch.zeros(self.size * world_size, dtype=p0.dtype, device=p0.device)
        for p, start, n in zip(params, self.starts, self.numels):
            self.full[start:start + n].copy_(p.detach().view(-1))
            p.data = self.full[start:start + n].view_as(p)  # the model now reads the buffer
        if sharded_storage:  # stage 3: the shard has storage of its own; the full buffer comes and goes
            self.shard = nn.Parameter(self.full[self.lo:self.hi].clone())
            self.free()
        else:  # stages 1, 2: the shard is a window on the full buffer
            self.shard = nn.Parameter(self.full[self.lo:self.hi])
        self.shard_grad = torch.zeros_like(self.shard)  # the sum of this shard's gradients
        self.shard.flat_shards = self  # where a checkpoint's shard lies in the parameters (state._local_places)
        self.shard.grad = self.shard_grad  # always: the optimizer and the memory tracker see it as a gradient

    def owners(self, start: int, end: int):
        """(rank, lo, hi) for every rank whose shard holds part of the flat range
        [start, end): that part is [lo, hi)."""
        for rank in range(start // self.size, (end - 1) // self.size + 1):
            yield rank, max(start, rank * self.size), min(end, (rank + 1) * self.size)

    def gather(self) -> None:
        """All-gather the shards into the full buffer (stage 3). Written through `.data`, so
        autograd's record of the parameters saved for backward stays valid."""
        if self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            dist.all_gather_single(self.full.data, self.shard.data, group=self.group)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def reduce_scatter_grads(self) -> None:
        """Add the sum over ranks of this group's gradients, shard r, into rank r's
        `shard_grad`; drop the full gradients."""
        flat = torch.zeros_like(self.full)
        for p, start, n in zip(self.params, self.starts, self.numels):
            if p.grad is not None:  # a parameter this batch did not use adds nothing
                flat[start:start + n].copy_(p.grad.reshape(-1))
                p.grad = None
        mine = torch.empty_like(self.shard_grad)
        dist.reduce_scatter_single(mine, flat, group=self.group)
        self.shard_grad += mine


class Zero:
    """One object per run: the flat groups, the optimizer over the shards, and the loop's
    steps for stage 1, 2 or 3."""

    def __init__(self, model: nn.Module, cfg, rt, stage: int):
        # the data-parallel ranks share out the model states; rank r below is the r-th of them
        self.group = rt.grid.group("dp")
        self.model, self.stage, self.world_size = model, stage, dist.get_world_size(self.group)
        for p in model.parameters():  # every rank starts from the group's first rank's weights
            dist.broadcast(p.data, group=self.group, group_src=0)
        if stage < 3:
            self.groups = [FlatShards(list(model.parameters()), self.group, sharded_storage=False)]
        else:
            self.groups = self._units(model)
        self.optimizer = build_optimizer([g.shard for g in self.groups], cfg)
        if stage == 1:  # gradients accumulate into one flat buffer, reduce-scattered once;
            # this rank's shard of their sum goes back into its own window of it
            group = self.groups[0]
            self.flat_grad = torch.zeros_like(group.full)
            group.shard_grad = group.shard.grad = self.flat_grad[group.lo:group.hi]
            self._point_grads_at_flat_buffer()
        if stage == 2:  # gradients leave in buckets, filled in the order backward produces them
            self.buckets = _buckets(self.groups[0], cfg.bucket_cap_mb)
            for bucket in self.buckets:
                for i in bucket.indices:
                    self.groups[0].params[i].register_post_accumulate_grad_hook(
                        lambda p, i=i, b=bucket: self._grad_ready(b, i, p))

    # -- stage 1 ------------------------------------------------------------------------
    def _point_grads_at_flat_buffer(self) -> None:
        group = self.groups[0]
        for p, start, n in zip(group.params, group.starts, group.numels):
            p.grad = self.flat_grad[start:start + n].view_as(p)  # backward adds into these

    # -- stage 2 ------------------------------------------------------------------------
    def _grad_ready(self, bucket: Bucket, i: int, p: nn.Parameter) -> None:
        """Backward just finished p's gradient: copy it into its bucket and drop it; a full
        bucket goes to the owners."""
        group = self.groups[0]
        if bucket.flat is None:  # the bucket's buffer lives only while it fills
            bucket.flat = torch.zeros(bucket.end - bucket.start, dtype=p.dtype, device=p.device)
        offset = group.starts[i] - bucket.start
        bucket.flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None  # this rank keeps no other gradient
        bucket.ready += 1
        if bucket.ready == len(bucket.indices):
            self._send_to_owners(bucket)

    def _send_to_owners(self, bucket: Bucket) -> None:
        """Each piece of the bucket to the rank that owns it, summed over ranks."""
        group, rank = self.groups[0], dist.get_rank(self.group)
        for owner, lo, hi in group.owners(bucket.start, bucket.end):
            piece = bucket.flat[lo - bucket.start:hi - bucket.start]
            dist.reduce(piece, group=self.group, group_dst=owner)
            if owner == rank:
                group.shard_grad[lo - group.lo:hi - group.lo] += piece
        bucket.flat, bucket.ready = None, 0

    # -- stage 3 ------------------------------------------------------------------------
    def _units(self, model: nn.Module) -> list[FlatShards]:
        """One group per transformer block, gathered and freed around its forward and
        backward; one for the rest (embeddings, final norm, head), gathered for the step."""
        blocks = transformer_blocks(model)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        if len(in_blocks) != sum(len(list(b.parameters())) for b in blocks):
            raise ValueError("zero3 needs each parameter in one block only (a weight shared by two blocks "
                             "would be flattened twice)")
        rest = [p for p in model.parameters() if id(p) not in in_blocks]
        self.root = FlatShards(rest, self.group, sharded_storage=True)
        model.register_forward_pre_hook(lambda m, args: self.root.gather())
        units = [self.root]
        for block in blocks:
            unit = FlatShards(list(block.parameters()), self.group, sharded_storage=True)
            block.register_forward_pre_hook(lambda m, args, u=unit: u.gather())
            block.register_forward_hook(lambda m, args, out, u=unit: self._after_forward(u, out))
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._after_grad(u))
            units.append(unit)
        return units

    def _after_forward(self, unit: FlatShards, out) -> None:
        if unit.in_backward:  # a recomputation (activation checkpointing) inside backward
            return
        unit.free()
        unit.awaiting_backward = True
        outputs = [t for t in (out if isinstance(out, tuple) else (out,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in outputs:  # backward reaches the block: gather it again first
            t.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit: FlatShards) -> None:
        # an output that is not the block's last use (T5 passes one position-bias tensor
        # through every block) may get its gradient after the block's backward is done
        if not unit.awaiting_backward:
            return
        unit.in_backward = True
        unit.gather()

    def _after_grad(self, unit: FlatShards) -> None:
        unit.grads_ready += 1
        if unit.grads_ready == sum(p.requires_grad for p in unit.params):  # the block's backward is done
            self._finish_unit(unit)

    def _finish_unit(self, unit: FlatShards) -> None:
        unit.reduce_scatter_grads()
        unit.free()
        unit.in_backward, unit.awaiting_backward, unit.grads_ready = False, False, 0

    # -- the loop's steps ------------------------------------------------------------------
    def finish_backward(self) -> None:
        if self.stage == 1:  # this rank's shard of the summed gradients, back into its place
            group = self.groups[0]
            mine = torch.empty_like(group.shard_grad)
            dist.reduce_scatter_single(mine, self.flat_grad, group=self.group)
            group.shard_grad.copy_(mine)
        if self.stage == 2:  # a bucket holding a parameter this batch did not use
            for bucket in self.buckets:
                if bucket.ready:
                    self._send_to_owners(bucket)
        if self.stage == 3:
            # the rest of the model, and any block some of whose parameters this batch did
            # not reach: their gradients are complete now (every rank runs the same model,
            # so every rank makes the same calls)
            for unit in self.groups:
                if unit is self.root or unit.grads_ready:
                    self._finish_unit(unit)
        for g in self.groups:
            g.shard_grad.div_(self.world_size)  # the mean over ranks, as DDP's (it is the shard's .grad)

    def step(self) -> None:
        self.optimizer.step()
        if self.stage < 3:  # everyone needs the whole updated model for the next forward
            group = self.groups[0]
            dist.all_gather_single(group.full.data, group.shard.detach().clone(), group=self.group)
        else:  # a block a late gradient gathered again must not keep its old weights
            for unit in self.groups:
                unit.free()

    def zero_grad(self) -> None:
        for g in self.groups:  # in place: a shard's gradient keeps its storage from step to step
            g.shard_grad.zero_()
        if self.stage == 1:
            self.flat_grad.zero_()
            self._point_grads_at_flat_buffer()

    def gather_state_dict(self) -> dict:
        for g in self.groups:
            g.gather()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.stage == 3:
            for g in self.groups:
                g.free()
        return state


@dataclass
class Bucket:
    """Consecutive parameters [indices] of a flat group, elements [start, end) of it."""
    indices: list[int]
    start: int
    end: int
    ready: int = 0  # gradients arrived so far this backward
    flat: torch.Tensor | None = None


def _buckets(group: FlatShards, cap_mb: float) -> list[Bucket]:
    """Last parameters first (backward's order), each bucket a contiguous range of the flat
    group holding up to `cap_mb` of gradients, and at most one shard's worth: then the
    gradients a rank holds never exceed two shards (its own, and the bucket filling). A
    parameter larger than that (a big embedding) is never split: it gets a bucket of its own."""
    cap = min(cap_mb * 2**20 / group.full.element_size(), group.size)
    buckets: list[Bucket] = []
    for i in reversed(range(len(group.params))):
        start, end = group.starts[i], group.starts[i] + group.numels[i]
        if buckets and buckets[-1].end - start <= cap:
            buckets[-1].indices.append(i)
            buckets[-1].start = start
        else:
            buckets.append(Bucket([i], start, end))
    return buckets


def prepare(model, cfg, rt) -> Parallelized:
    zero = Zero(model, cfg, rt, stage=ZERO_STAGE[cfg.strategy])

    def step():
        zero.finish_backward()  # the last gradients to their owners, then the update
        zero.step()

    return Parallelized(module=model, optimizer=zero.optimizer, model=model, zero_grad=zero.zero_grad, step=step,
                        gather_state_dict=zero.gather_state_dict, checkpoint_names="local",  # flat shards
                        tracked=[nn.ParameterList([g.shard for g in zero.groups])])  # shards and their .grad
