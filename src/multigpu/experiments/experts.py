"""The experiments of chapter "Mixture of experts and expert parallelism": where the router sends
tokens over a short training run, with and without the balancing loss; the tokens dropped as the
capacity factor tightens; and expert parallelism against data parallelism of the same model (memory
per rank, the all-to-all's bytes, step time).

All on gpt-moe-small (6 layers of 8 experts, 2 per token, 27.4M parameters of which 8.5M compute
per token). The routing runs train on one device: the router, not the ranks, decides the load. The
ep runs train on 2 and up to 4 ranks; on GPUs they go to NCCL where there are enough of them.
"""

from __future__ import annotations

from multigpu.config import RunConfig
from multigpu.experiments.machine import ddp_device, max_world_size, on_gpus

MODEL = "gpt-moe-small"
CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def _base(**changes) -> RunConfig:
    return RunConfig(model=MODEL, global_batch_size=8, seq_len=256, optimizer="adamw", lr=1e-3,
                     dataset="synthetic", **changes)


AUX_COEFS = (0.0, 0.01, 0.1)  # off, Switch's, ten times Switch's


def moe_balance() -> list[RunConfig]:
    """120 steps on one device, the balancing loss off, at Switch's 0.01 and at 0.1: tokens each
    expert of every layer is routed at every step (no capacity: nothing dropped, the router's choice
    alone)."""
    return [_base(steps=120, track_memory=False, extra={"moe_aux_loss_coef": coef}) for coef in AUX_COEFS]


def moe_capacity() -> list[RunConfig]:
    """20 steps on one device at each capacity factor: the share of (token, expert) assignments
    dropped, and what the loss makes of it."""
    return [_base(steps=20, track_memory=False, extra={"moe_capacity_factor": cf}) for cf in CAPACITY_FACTORS]


def moe_ep() -> list[RunConfig]:
    """ep-scratch on 2 and 4 ranks with the experts cut over all of them (ep = dp) and with none cut
    (ep 1: data parallel of the same model), alternated twice (A B A B): memory per rank by category,
    the collectives' bytes per step (counted, and on the loopback wire) and every rank's step time."""
    worlds = [w for w in (2, 4) if w <= max_world_size()]
    return [_base(strategy="ep-scratch", world_size=world, ep=ep, steps=6, device=ddp_device(),
                  threads_per_worker=None if on_gpus(2) else 1, extra={"repeat": repeat})
            for world in worlds for repeat in range(2) for ep in (world, 1)]
