"""Parity checks for context parallelism from scratch (multigpu.strategies.cp_attention).

Each function runs inside a process group of cp ranks, via
`multigpu.spmd.run_spmd("spmd.cp_checks:<name>", cp)` (tests/test_cp.py): every rank builds the
same whole-sequence tensors from one seed, runs PyTorch's own attention on all of it (the
reference), then the context-parallel attention on its own tokens, and returns the largest
absolute differences of the output and of the three input gradients, with the collectives
counted, so that the test can judge them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from multigpu.comm import CommCounter
from multigpu.strategies import cp_attention as cpa


def attention_checks(variants=cpa.VARIANTS, balances=cpa.BALANCES, seed: int = 0, batch: int = 2, heads: int = 4,
                     seq_len: int = 32, head_dim: int = 8) -> dict:
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, heads, seq_len, head_dim, dtype=torch.float64) for _ in range(4))
    out = {}
    for causal in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        ref.backward(dout)
        for balance in balances:
            def mine(t, balance=balance):
                return cpa.split_sequence(t.detach(), -2, cp, rank, balance)

            for variant in variants:
                parts = [mine(t).requires_grad_() for t in (q, k, v)]
                with CommCounter(cp) as counter:
                    y = cpa.attention(*parts, group=group, variant=variant, balance=balance, causal=causal)
                    forward_sent = dict(counter.sent_bytes)
                    y.backward(mine(dout))
                key = f"{variant}/{balance}/{'causal' if causal else 'full'}"
                out[key] = {"out": (y - mine(ref)).abs().max().item(),
                            **{f"d{n}": (p.grad - mine(r.grad)).abs().max().item()
                               for n, p, r in zip("qkv", parts, leaves)},
                            "forward_sent": forward_sent, "sent": dict(counter.sent_bytes)}
    return out
