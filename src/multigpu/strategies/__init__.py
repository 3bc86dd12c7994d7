"""Strategies: how a model is spread over processes and how its gradients meet.

Each strategy is one file with a `prepare(model, cfg, rt) -> Parallelized` function; which
file serves which name is the strategy table (`multigpu.strategy_table.STRATEGY_TABLE`). The shared
training loop (multigpu.train) times and measures a step function around what
`Parallelized` offers, so every strategy is trained, timed and measured by the same code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.models import apply_activation_checkpointing, compute_loss


class LossScaler:
    """fp16-mixed's loss scaling: torch.amp.GradScaler, and what it did at every step.

    float16 keeps 5 exponent bits: magnitudes below about 6e-8 flush to zero, above 65504
    overflow. Small gradients of activations would vanish in backward, so the loss is
    multiplied by a large scale before backward (every gradient with it), and the fp32
    gradients are divided by it again before the update. A step whose gradients hold an inf
    or a NaN is skipped and the scale halved; after `growth_interval` clean steps it doubles.
    bf16 has fp32's 8 exponent bits and needs none of this."""

    def __init__(self, device_type: str, **kwargs):
        self.scaler = torch.amp.GradScaler(device_type, **kwargs)
        self.scale_by_step: list[float] = []  # the scale each step's loss was multiplied by
        self.skipped_steps: list[int] = []  # steps whose gradients overflowed: no update, scale halved

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients, step only if all are finite, then adjust the scale. The scale
        falls only after an overflow (growth never lowers it), which is how a skip is seen."""
        used = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < used:
            self.skipped_steps.append(len(self.scale_by_step))
        self.scale_by_step.append(used)

    def report(self) -> dict:
        return {"loss_scale_by_step": list(self.scale_by_step), "skipped_steps": list(self.skipped_steps)}


@dataclass
class Parallelized:
    """A model spread by a strategy, and the calls that train it. The plain micro-batch step
    (`micro_batch_step`) uses the calls below; a strategy whose step is a different
    algorithm (a pipeline schedule owns its micro-batches) replaces it with `train_step`."""

    module: nn.Module  # call this in forward
    optimizer: torch.optim.Optimizer
    model: nn.Module  # the plain model underneath, for reading the trained weights
    no_sync: Callable = nullcontext  # context: accumulate gradients locally, no communication
    tracked: list = field(default_factory=list)  # tensors made in prepare (e.g. buckets)
    report: Callable[[], dict] | None = None  # the strategy's own measurements, for the record
    # True: no memory tracker on this strategy: `report` gives memory per replica (dp), or
    # the tracker cannot follow it (then its categories are recorded as None: not measured)
    counts_own_memory: bool = False
    # the calls of a step, for strategies that must do more than the plain ones
    zero_grad: Callable[[], None] | None = None  # default: optimizer.zero_grad(set_to_none=True)
    backward: Callable[[torch.Tensor], None] | None = None  # default: loss.backward()
    step: Callable[[], None] | None = None  # finish gradient communication, update; default: optimizer.step()
    gather_state_dict: Callable[[], dict] | None = None  # sharded strategies: gather whole weights
    train_step: Callable | None = None  # same signature as micro_batch_step, which is the default
    scaler: LossScaler | None = None  # fp16-mixed: the loss scaling micro_batch_step applies
    # a context around one micro-batch's forward and backward, given the batch (PyTorch's
    # context_parallel, which cuts the batch's tensors in place and swaps attention inside it)
    around_micro_batch: Callable[[dict], object] | None = None
    # how its checkpoints name the state (checkpoint.py): "canonical" (the single-device names, whole or as
    # DTensor shards: loadable under any layout), "local" (its own pieces under each rank's keys: the same
    # layout only) or "deepspeed" (the engine saves itself)
    checkpoint_names: str = "canonical"
    # "deepspeed": how the engine takes whole tensors under the single-device names (a canonical checkpoint)
    load_whole: Callable[[dict], None] | None = None

    def __post_init__(self):
        self.zero_grad = self.zero_grad or (lambda: self.optimizer.zero_grad(set_to_none=True))
        self.backward = self.backward or (lambda loss: loss.backward())
        self.step = self.step or self.optimizer.step

    def run_step(self, micro_batches: list[dict], autocast_dtype=None, before_forward=lambda i: None) -> float:
        return (self.train_step or micro_batch_step)(self, micro_batches, autocast_dtype, before_forward)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on CPU, on every rank."""
        state = self.gather_state_dict() if self.gather_state_dict else self.model.state_dict()
        return {k: v.detach().cpu().clone() for k, v in state.items()}


def micro_batch_step(par: Parallelized, micro_batches: list[dict], autocast_dtype: torch.dtype | None = None,
                     before_forward=lambda i: None) -> float:
    """One optimizer step: forward and backward of each micro-batch, gradients summed
    locally (no_sync) on all but the last, whose backward communicates; then the update.
    Each micro-batch's loss is divided by their number, so the gradient is the mean over the
    whole batch, as one big batch would give. Returns the step's loss.
    autocast_dtype: forward under autocast to this dtype (bf16 or fp16 mixed precision), or None.
    With `par.scaler` (fp16-mixed) each micro-batch's loss is scaled before its backward, so the
    summed gradients carry one scale, and the scaler unscales, checks and steps once at the end.
    before_forward(i): called before micro-batch i's forward (the memory tracker's marks)."""
    par.zero_grad()
    step_loss = None  # summed on the device: one host sync per step, not one per micro-batch
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        device_type = next(iter(batch.values())).device.type
        before_forward(i)
        with (nullcontext() if last else par.no_sync()), (par.around_micro_batch or _nothing)(batch):
            mixed = autocast_dtype is not None
            with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=mixed):
                loss = compute_loss(par.module, batch) / len(micro_batches)
            par.backward(par.scaler.scale(loss) if par.scaler else loss)
        # in float64, one addition at a time: the same sum as Python's over loss.item()s
        step_loss = loss.detach().double() if step_loss is None else step_loss + loss.detach().double()
    if par.scaler:
        par.scaler.step(par.optimizer)
    else:
        par.step()
    return host_value(step_loss)


def host_value(t: torch.Tensor) -> float:
    """A step's loss read on the host (one sync per step). A dry run's loss is a fake tensor (multigpu.dryrun):
    it has a shape and no value, so it reads as nan."""
    from torch._subclasses.fake_tensor import is_fake

    return float("nan") if is_fake(t) else t.item()


def _nothing(batch):
    return nullcontext()


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
    """The strategy the table names for `cfg.strategy`, applied to `model`.

    Activation checkpointing is applied here, before the strategy, unless the strategy
    applies it itself at its place in the order of `compose.py` (after the pipeline split
    and tensor parallelism); for a strategy that keeps whole layers the two are the same."""
    strategy = importlib.import_module(f"multigpu.strategies.{cfg.info.module}")
    if cfg.activation_checkpointing and not cfg.info.checkpoints_itself:
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
    par = strategy.prepare(model, cfg, rt)
    if cfg.dtype == "fp16-mixed":  # RunConfig.validate admits it only where the plain step is right
        if par.train_step is not None or par.step != par.optimizer.step:
            raise ConfigError(f"strategy {cfg.strategy!r} replaces the plain optimizer step, which fp16-mixed's "
                              "GradScaler must take over; use bf16-mixed")
        par.scaler = LossScaler(rt.device.type)
    return par
