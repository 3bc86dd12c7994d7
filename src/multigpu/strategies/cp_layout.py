"""Which tokens of a sequence each rank of a context-parallel group holds, what work that leaves
each rank under the causal mask, and the bytes each way of moving keys and values sends: the
arithmetic of context parallelism, apart from the attention that runs on it (cp_attention).

The sequence is cut into chunks: `contiguous` gives rank r chunk r of cp; `zigzag` (head-tail:
Megatron-LM's layout, megatron/core/models/common/embeddings/rope_utils.py, and PyTorch's
`_HeadTailLoadBalancer`, which torchtitan uses) cuts it into 2cp chunks and gives rank r chunks r
and 2cp-1-r. Brandon et al. 2023 (Striped Attention, https://arxiv.org/abs/2311.09431) showed the
causal imbalance of contiguous chunks and balance it another way, not built here: stripes, token i
on rank i mod cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VARIANTS = ("ring", "allgather", "ulysses")
BALANCES = ("zigzag", "contiguous")


# -- which tokens each rank holds ----------------------------------------------------------

def chunks_per_rank(balance: str) -> int:
    if balance not in BALANCES:
        raise ValueError(f"unknown balance {balance!r}; choose one of: {', '.join(BALANCES)}")
    return 2 if balance == "zigzag" else 1


def layout(cp: int, balance: str) -> list[list[int]]:
    """The chunks each rank holds, in the order it holds them: rank r's are layout[r]."""
    if chunks_per_rank(balance) == 1:
        return [[r] for r in range(cp)]
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def sequence_problem(seq_len: int, cp: int, balance: str) -> str | None:
    """Why a sequence of seq_len tokens cannot be cut for cp ranks with `balance`, or None."""
    pieces = cp * chunks_per_rank(balance)
    if seq_len % pieces:
        return (f"a sequence of {seq_len} tokens does not cut into {pieces} equal chunks ({balance} layout on cp={cp}"
                f"{': 2 x cp, an early and a late one per rank' if balance == 'zigzag' else ''}); use a sequence "
                f"length that is a multiple of {pieces}")
    return None


def split_sequence(x: torch.Tensor, dim: int, cp: int, rank: int, balance: str) -> torch.Tensor:
    """This rank's tokens of x (the whole sequence along `dim`), its chunks side by side."""
    chunks = x.chunk(cp * chunks_per_rank(balance), dim)
    return torch.cat([chunks[c] for c in layout(cp, balance)[rank]], dim)


def positions(seq_len: int, cp: int, rank: int, balance: str, device=None) -> torch.Tensor:
    """The positions in the whole sequence of this rank's tokens (for position embeddings)."""
    return split_sequence(torch.arange(seq_len, device=device), 0, cp, rank, balance)


# -- the schedule: which (query chunk, key chunk) pairs a rank computes --------------------

@dataclass(frozen=True)
class ChunkSchedule:
    """The work of one rank's queries against the keys of every rank, chunk by chunk. Under the
    causal mask a query chunk a meets key chunk b in full when a > b, half of it (the diagonal
    block, computed whole with a mask) when a == b, and not at all when a < b."""

    cp: int
    balance: str
    causal: bool

    def pairs(self, rank: int, source: int) -> list[tuple[int, int, str]]:
        """(i, j, kind) for query chunk i of `rank` against key chunk j of `source`'s (indices
        into their layouts), kind "full" or "diagonal"; pairs that meet nothing are left out."""
        lay = layout(self.cp, self.balance)
        out = []
        for i, a in enumerate(lay[rank]):
            for j, b in enumerate(lay[source]):
                if not self.causal or a > b:
                    out.append((i, j, "full"))
                elif a == b:
                    out.append((i, j, "diagonal"))
        return out

    def blocks(self, rank: int) -> int:
        """The chunk-by-chunk blocks of scores this rank computes in one forward, all sources."""
        return sum(len(self.pairs(rank, s)) for s in range(self.cp))

    def flops(self, rank: int, batch: int, heads: int, seq_len: int, head_dim: int) -> int:
        """Forward matmul FLOPs of this rank's attention (scores and scores x values, 2 x 2 x c x c x d
        per block of c x c, diagonal blocks computed whole): the ring's and the all-gather's work.
        Backward does twice this (four matmuls per block instead of two)."""
        c = seq_len // (self.cp * chunks_per_rank(self.balance))
        return self.blocks(rank) * 4 * batch * heads * c * c * head_dim


def sent_bytes_per_layer(variant: str, cp: int, batch: int, heads: int, seq_len: int, head_dim: int,
                         element_size: int) -> dict[str, int]:
    """Bytes one rank sends for one attention layer, forward and backward: the formulas.

    With a = batch x heads x (seq_len / cp) x head_dim x element_size, one rank's queries (or its
    keys, values, output) and kv = 2a its keys and values:
    - ring: forward passes kv on cp - 1 times; backward passes kv on cp - 1 times and the key
      and value gradients cp times (the last pass brings them home): (2cp - 1) kv.
    - allgather: the all-gather sends one's kv to the cp - 1 others, (cp - 1) kv; backward's
      reduce-scatter of the gathered gradients, (cp - 1)/cp of cp x kv: (cp - 1) kv again.
    - ulysses: four all-to-alls each way (q, k, v and the output; their gradients), each sending
      (cp - 1)/cp of a: 4 (cp - 1)/cp a, the same forward and backward, and falling with cp."""
    a = batch * heads * (seq_len // cp) * head_dim * element_size
    kv = 2 * a
    if variant == "ring":
        return {"forward": (cp - 1) * kv, "backward": (2 * cp - 1) * kv}
    if variant == "allgather":
        return {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv}
    if variant == "ulysses":
        return {"forward": 4 * (cp - 1) * a // cp, "backward": 4 * (cp - 1) * a // cp}
    raise ValueError(f"unknown context-parallel attention {variant!r}; choose one of: {', '.join(VARIANTS)}")
