"""Parity checks for expert parallelism from scratch (multigpu.strategies.ep_scratch).

`layer_checks` runs inside a process group of ep ranks, via
`multigpu.spmd.run_spmd("spmd.ep_checks:layer_checks", ep)` (tests/test_moe.py): every rank builds
the same MoE layer and the same whole batch from one seed, runs the layer on all of it (the
reference: one device), then the expert-parallel layer on its own samples, its experts cut over
the ranks, and returns the largest differences of the output, the input's gradient and every
parameter's gradient, with the all-to-all's bytes counted, for the test to judge.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from multigpu import moe
from multigpu.comm import CommCounter
from multigpu.strategies import ep_scratch


def layer_checks(top_k: int = 2, capacity_factor=None, experts: int = 8, d_model: int = 16, batch: int = 4,
                 seq: int = 12, seed: int = 0) -> dict:
    ep, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float64)
    try:
        layer = moe.MoE(d_model, moe.MoEConfig(experts, top_k, d_ff=2 * d_model, capacity_factor=capacity_factor,
                                               shared_experts=1))
        x, dout = torch.randn(batch * ep, seq, d_model), torch.randn(batch * ep, seq, d_model)
    finally:
        torch.set_default_dtype(torch.float32)
    whole = x.clone().requires_grad_()
    reference = copy.deepcopy(layer)
    ref_out = reference(whole)
    ((ref_out * dout).sum() + reference.aux_loss).backward()

    mine = slice(rank * batch, (rank + 1) * batch)
    from multigpu.runtime import RankGrid

    ep_scratch.parallelize(layer, RankGrid.build("cpu", dp=ep), ep)  # every rank of the world a dp rank
    part = x[mine].clone().requires_grad_()
    with CommCounter(ep) as counter:
        out = layer(part)
        forward_payload = dict(counter.payload_bytes)
        # the whole batch's loss: the mean over ranks of theirs is the reference's / ep, so times ep
        ((out * dout[mine]).sum() + layer.aux_loss / ep).backward()
    grads = {}
    for name, p in layer.named_parameters():
        g = p.grad.clone()
        if name.startswith("experts."):  # this rank's experts: gather them all
            parts = [torch.empty_like(g) for _ in range(ep)]
            dist.all_gather(parts, g)
            g = torch.cat(parts)
        else:  # dense: every rank's share of the gradient, summed
            dist.all_reduce(g)
        grads[name] = (g - dict(reference.named_parameters())[name].grad).abs().max().item()
    kept = int(layer.load[-1][:experts].sum() - layer.load[-1][experts])
    return {"output": (out - ref_out[mine]).abs().max().item(),
            "input_grad": (part.grad - whole.grad[mine]).abs().max().item(), "param_grads": grads,
            "same_load": torch.equal(layer.load[-1], reference.load[-1]), "dropped": int(layer.load[-1][experts]),
            "kept_assignments": kept, "forward_payload": forward_payload, "payload": dict(counter.payload_bytes),
            "tokens": batch * seq}
