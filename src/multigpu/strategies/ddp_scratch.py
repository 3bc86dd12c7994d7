"""Data parallel from scratch: what DistributedDataParallel does, in about 100 lines.

1. Every rank starts from the same weights: broadcast them from rank 0.
2. Each rank runs forward and backward on its own slice of the global batch.
3. Gradients are averaged over ranks with all-reduce, so every rank takes the same
   optimizer step and the replicas stay identical.

Step 3 is where the speed is. One all-reduce per parameter tensor would pay the
per-message latency once per tensor; one all-reduce after backward would leave the network
idle while backward computes. So, like DDP, we pack gradients into buckets of about
`bucket_cap_mb` and launch a bucket's all-reduce (asynchronously) the moment its last
gradient is ready, while backward goes on computing earlier layers' gradients.
(Li et al. 2020, "PyTorch Distributed", https://arxiv.org/abs/2006.15704)

With `--tp N` it is 2D from scratch: the layers are first swapped for tp_scratch's
column- and row-parallel ones over each group of N consecutive ranks (Megatron), then the
buckets average each rank's weight shards with the ranks holding the same shards in the
other replicas (the dp group). Tensor parallel first, data parallel last: the order of
`compose.py`, by hand.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from multigpu.strategies import Parallelized, build_optimizer


class GradBuckets:
    def __init__(self, params, group, bucket_cap_mb: float, divide_by: int | None = None):
        self.group = group  # the data-parallel ranks: the replicas whose gradients are averaged
        # the sum over the group is divided by its size (an average), or by `divide_by` (ep_scratch's
        # experts: their gradients are summed over more ranks than the group holds)
        self.divide_by = divide_by or dist.get_world_size(group)
        self.enabled = True  # False inside no_sync(): gradients just accumulate locally
        # Backward produces gradients from the last layer to the first, so we fill buckets
        # in reverse registration order: the first bucket is the first to be ready.
        cap_bytes = bucket_cap_mb * 2**20
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        filled = 0
        for p in reversed(params):
            if filled >= cap_bytes:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(p)
            filled += p.numel() * p.element_size()
        # one flat buffer per bucket: a single all-reduce moves the whole bucket
        self.flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                     for b in self.buckets]
        self.where = {}  # parameter -> (bucket index, offset in its flat buffer)
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
        self._reset()
        for p in params:  # fires once p.grad holds this backward's full gradient
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _reset(self):
        self.missing = [len(b) for b in self.buckets]  # gradients not yet ready, per bucket
        self.handles = [None] * len(self.buckets)  # in-flight all-reduces
        self.next_to_launch = 0

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        i, offset = self.where[p]
        self.flat[i][offset:offset + p.numel()].copy_(p.grad.view(-1))
        self.missing[i] -= 1
        # Launch buckets strictly in order: every rank must issue the same collectives in
        # the same order, even if its gradients became ready in a different one.
        while self.next_to_launch < len(self.buckets) and self.missing[self.next_to_launch] == 0:
            flat = self.flat[self.next_to_launch]
            flat.div_(self.divide_by)  # sum of (g / N) over N ranks = the average gradient
            self.handles[self.next_to_launch] = dist.all_reduce(flat, group=self.group, async_op=True)
            self.next_to_launch += 1

    def finish(self) -> None:
        """After backward: wait for every bucket, then hand the averages back to .grad."""
        if not self.enabled:
            return
        if self.next_to_launch < len(self.buckets):
            unused = [p.shape for p in self.buckets[self.next_to_launch] if p.grad is None]
            raise RuntimeError(
                f"gradient buckets (ddp-scratch, cp-scratch, ep-scratch): bucket {self.next_to_launch} never "
                f"became ready; parameters of shapes {unused} got no gradient. Every parameter must be used in "
                "forward."
            )
        for i, handle in enumerate(self.handles):
            handle.wait()
            for p in self.buckets[i]:
                _, offset = self.where[p]
                p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p))
        self._reset()

    @contextmanager
    def no_sync(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


def config_problems(cfg) -> list[str]:
    """What RunConfig.validate reports before any process starts."""
    from multigpu.models import family

    if cfg.degrees["tp"] > 1 and family(cfg.model) != "gpt":
        return [f"with --tp it swaps the package's GPT layers for tp-scratch's, not {cfg.model}'s; "
                "use --strategy fsdp --tp for a Hugging Face model"]
    return []


def prepare(model, cfg, rt) -> Parallelized:
    module, tp_step, gather = model, (lambda: None), None
    if rt.grid.size("tp") > 1:  # tensor parallel first: the buckets then hold this rank's shards
        from multigpu.strategies import tp_scratch
        from multigpu.strategies.state import sliced_state_dict

        tp_group, sp = rt.grid.group("tp"), bool(cfg.extra.get("sequence_parallel", False))
        module = tp_scratch.parallelize(model, tp_group, sp)
        gather = partial(sliced_state_dict, model, tp_group)
        if sp:
            tp_step = partial(tp_scratch.sync_sequence_parallel_grads, model, tp_group)
    # no wrapper: forward is the plain model's (or tp_scratch's, with --tp)
    # tp-scratch's slices are plain tensors: each rank's checkpoint holds its own under its keys
    return replicated(model, module, cfg, rt.grid.group("dp"), before_step=tp_step, gather_state_dict=gather,
                      checkpoint_names="local" if gather else "canonical")


def replicated(model, module, cfg, group, before_step=lambda: None, **calls) -> Parallelized:
    """`model` trained by the ranks of `group`, each holding the same parameters (or the same
    shards), `module` the call that computes its loss: steps 1-3 above. before_step: what must
    happen between the averaged gradients and the update (sequence parallelism's sums); `calls`:
    more of Parallelized's fields (also what context parallelism, cp_scratch, trains with)."""
    with torch.no_grad():  # 1. same starting point everywhere: the group's first rank's weights
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, group=group, group_src=0)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = GradBuckets(params, group, cfg.bucket_cap_mb)
    optimizer = build_optimizer(params, cfg)

    def step():
        buckets.finish()  # 3. wait for the last all-reduces, then update with the averages
        before_step()
        optimizer.step()

    return Parallelized(module=module, optimizer=optimizer, model=model, no_sync=buckets.no_sync, step=step,
                        tracked=buckets.flat, **calls)
