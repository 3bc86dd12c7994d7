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
    # the steps of the loop, for strategies that must do more than the plain calls
    zero_grad: Callable[[], None] | None = None  # default: optimizer.zero_grad(set_to_none=True)
    backward: Callable[[torch.Tensor], None] | None = None  # default: loss.backward()
    step: Callable[[], None] | None = None  # default: optimizer.step()
    gather_state_dict: Callable[[], dict] | None = None  # sharded strategies: gather whole weights

    def __post_init__(self):
        self.zero_grad = self.zero_grad or (lambda: self.optimizer.zero_grad(set_to_none=True))
        self.backward = self.backward or (lambda loss: loss.backward())
        self.step = self.step or self.optimizer.step

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on CPU, on every rank."""
        state = self.gather_state_dict() if self.gather_state_dict else self.model.state_dict()
        return {k: v.detach().cpu().clone() for k, v in state.items()}


def optimizer_spec(cfg) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer's class and keyword arguments (for wrappers that build it themselves)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, {"lr": cfg.lr}
    if cfg.optimizer == "sgd-momentum":
        return torch.optim.SGD, {"lr": cfg.lr, "momentum": 0.9}
    if cfg.optimizer == "adam":
        return torch.optim.Adam, {"lr": cfg.lr}
    return torch.optim.AdamW, {"lr": cfg.lr}


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_spec(cfg)
    return cls(params, **kwargs)


def prepare(model: nn.Module, cfg, rt) -> Parallelized:
    from multigpu.strategies import ddp, ddp_scratch, deepspeed, dp, fsdp, fsdp1, single, zero, zero_torch

    by_name = {"single": single, "ddp": ddp, "ddp-scratch": ddp_scratch, "dp": dp,
               "zero1": zero, "zero2": zero, "zero3": zero, "zero1-torch": zero_torch,
               "fsdp": fsdp, "fsdp1": fsdp1,
               "deepspeed-zero1": deepspeed, "deepspeed-zero2": deepspeed, "deepspeed-zero3": deepspeed}
    return by_name[cfg.strategy].prepare(model, cfg, rt)
