"""Strategies: how a model is spread over processes and how its gradients meet.

Each strategy is one file with a `prepare(model, cfg, rt) -> Parallelized` function. The
shared training loop (multigpu.train) only calls what `Parallelized` offers, so every
strategy is trained, timed and measured by the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Parallelized:
    module: nn.Module  # call this in forward
    optimizer: torch.optim.Optimizer
    model: nn.Module  # the plain model underneath, for reading the trained weights
    no_sync: Callable = nullcontext  # context: accumulate gradients locally, no communication
    finish_backward: Callable[[], None] = lambda: None  # wait for gradient communication
    tracked: list = field(default_factory=list)  # tensors made in prepare (e.g. buckets)
    report: Callable[[], dict] | None = None  # the strategy's own measurements, for the record
    counts_own_memory: bool = False  # True: `report` gives memory per replica; skip the tracker

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on CPU (sharding strategies override by gathering)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=cfg.lr)


def prepare(model: nn.Module, cfg, rt) -> Parallelized:
    from multigpu.strategies import ddp, ddp_scratch, dp, single

    by_name = {"single": single, "ddp": ddp, "ddp-scratch": ddp_scratch, "dp": dp}
    return by_name[cfg.strategy].prepare(model, cfg, rt)
