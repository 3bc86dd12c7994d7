"""DeepSpeed ZeRO stages 1, 2 and 3: `deepspeed.initialize` from a JSON config.

DeepSpeed takes over three calls of the training loop: `engine(batch)` for forward,
`engine.backward(loss)` (which partitions gradients for stages 2 and 3) and `engine.step()`
(which updates each rank's shard and gathers the parameters). It counts micro-batches
itself: `engine.step()` after every micro-batch steps the optimizer only at the end of
`gradient_accumulation_steps` of them.

On a CPU, DeepSpeed runs with `DS_ACCELERATOR=cpu` over gloo. Its first run compiles a
small C++ extension; `TORCH_EXTENSIONS_DIR` keeps it under the checkout's `_build/` rather
than in the user's home (installed without a checkout: under ~/.cache/multigpu).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from multigpu.config import ZERO_STAGE
from multigpu.records import CHECKOUT
from multigpu.strategies import Parallelized, build_optimizer

EXTENSIONS_DIR = (CHECKOUT / "_build" if CHECKOUT else Path.home() / ".cache" / "multigpu") / "torch_extensions"


def config(cfg, stage: int) -> dict:
    """The DeepSpeed config for a run (the chapter shows it). The optimizer is the run's own
    torch optimizer, passed to `initialize`, so every strategy steps with the same code."""
    bucket = int(cfg.bucket_cap_mb * 2**20 / 4)  # the run's bucket size, as for DDP
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "train_batch_size": cfg.global_batch_size,
        "zero_optimization": {
            "stage": stage,
            # buckets in elements; DeepSpeed's default, 5e8, would hold 2 GB of fp32 gradients
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            **({"stage3_prefetch_bucket_size": bucket} if stage == 3 else {}),
            **cfg.extra.get("zero_optimization", {}),
        },
        # bf16-mixed as everywhere in the package: fp32 weights, forward under bf16 autocast,
        # fp32 gradients and reduction. DeepSpeed's "bf16" section would instead cast the
        # weights to bf16, and its engine switches off an autocast opened outside it on CUDA
        # but not on a CPU (deepspeed/runtime/torch_autocast.py, autocast_if_enabled): its own
        # torch_autocast section behaves the same on both; no module's gradients are
        # communicated in bf16 (lower_precision_safe_modules empty)
        "bf16": {"enabled": False},
        **({"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
           if cfg.dtype == "bf16-mixed" else {}),
        "zero_allow_untested_optimizer": True,  # a plain torch optimizer, not DeepSpeed's own,
        "zero_force_ds_cpu_optimizer": False,  # even when its state is offloaded to the CPU
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def config_problems(cfg) -> list[str]:
    from multigpu.recompute import LINEAR_IN_PLACE, recompute_mode

    if ZERO_STAGE[cfg.strategy] == 3 and recompute_mode(cfg.activation_checkpointing) == "selective":
        return [LINEAR_IN_PLACE + ": use activation_checkpointing=True (full recomputation) with it"]
    return []


def restore_torch_linear() -> None:
    """Undo ZeRO-3's replacement of torch.nn.functional.linear, which DeepSpeed says "will persist unless
    manually reset": a series of runs in one process (the worker's) starts each run as a fresh process would."""
    import sys

    init = getattr(sys.modules.get("deepspeed.runtime.zero.partition_parameters"),
                   "InsertPostInitMethodToModuleSubClasses", None)
    original = getattr(init, "linear_bk", None)
    if original is not None:
        import torch

        torch.nn.functional.linear = original


def import_deepspeed(device_type: str):
    """Import DeepSpeed for this device; the extension it compiles on first use goes to
    _build/. Ranks take turns, so that two never compile it at once."""
    # this run's device decides, not a DS_ACCELERATOR left in the shell (e.g. from a CPU run)
    os.environ["DS_ACCELERATOR"] = "cpu" if device_type == "cpu" else "cuda"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
    if dist.get_rank() != 0:
        dist.barrier()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator()  # loads (and, the first time, builds) what the accelerator needs
    if dist.get_rank() == 0:
        dist.barrier()
    return deepspeed


def prepare(model, cfg, rt) -> Parallelized:
    deepspeed = import_deepspeed(rt.device.type)
    stage = ZERO_STAGE[cfg.strategy]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model.parameters(), cfg),
                                                   config=config(cfg, stage))

    def backward(loss):
        # our loop already divides the loss by the accumulation steps
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()  # an optimizer step only at the last micro-batch of the step

    def gather_state_dict():
        if stage < 3:
            return model.state_dict()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    # the torch optimizer inside DeepSpeed's: it holds the fp32 shards and their state
    par = Parallelized(module=engine, optimizer=optimizer.optimizer, model=model, backward=backward,
                       step=lambda: None, zero_grad=lambda: None, gather_state_dict=gather_state_dict,
                       checkpoint_names="deepspeed")
    par.load_whole = lambda wholes: put_whole(par, wholes)
    return par


def put_whole(par, wholes: dict) -> None:
    """Load whole tensors under the single-device names (`model.<name>`, `optimizer.<name>.<key>`: a canonical
    checkpoint, read on every rank) into DeepSpeed's engine: each parameter's value into the model (ZeRO-3:
    gathered, set, partitioned again) and into the optimizer's fp32 partition, each optimizer state into its
    partition (DeepSpeed's `safe_set_full_fp32_param` and `safe_set_full_optimizer_state`), and the step count
    into every group's state. The optimizer's state is made first, as its first step would make it."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from multigpu.strategies.state import _make_optimizer_state

    inner = par.optimizer  # the torch optimizer over DeepSpeed's fp32 partitions
    zero = par.module.optimizer
    if not any(inner.state.values()):  # made at the first step, as torch's optimizers do
        flats = getattr(zero, "fp32_partitioned_groups_flat", None)
        if flats is None:
            _make_optimizer_state(inner)
        else:  # ZeRO-3 hands the optimizer its fp32 sub-groups only while it steps
            for i, flat in enumerate(flats):
                inner.param_groups[zero.sub_group_to_group_id[i]]["params"].append(flat)
            _make_optimizer_state(inner)
            for group in inner.param_groups:
                group["params"] = []
    # ZeRO-1/2 point each parameter at its fragment of the optimizer's state once that state exists
    getattr(zero, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    params = dict(par.model.named_parameters())  # a tied weight once, under its first name
    for name, p in params.items():
        value = wholes[f"model.{name}"].to(p.device)
        if hasattr(p, "ds_id"):  # ZeRO-3: the model's own partition
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(value)
        else:
            p.data.copy_(value)
        safe_set_full_fp32_param(p, value)
        for key in {k.rsplit(".", 1)[1] for k in wholes if k.startswith(f"optimizer.{name}.")} - {"step"}:
            safe_set_full_optimizer_state(p, wholes[f"optimizer.{name}.{key}"].to(p.device), key)
    steps = {float(v) for k, v in wholes.items() if k.startswith("optimizer.") and k.endswith(".step")}
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's parameters were stepped different numbers of times: {sorted(steps)}")
    for state in inner.state.values():
        if steps and "step" in state:
            state["step"].fill_(next(iter(steps)))

