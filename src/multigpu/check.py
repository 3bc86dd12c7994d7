"""Parity: does a strategy train exactly like one process on the same global batch?

`check` trains the strategy on N processes and the `single` reference on one process,
from the same seed, on the same global batches, for a few steps, then compares the
weights and the per-step losses. Floating-point sums in a different order differ in the
last bits, so we ask for agreement within `tolerance`, not bit equality.

One device's run is deterministic (the same config, seed and batches give the same weights),
and many strategies share one reference: the test suite checks every data-parallel strategy
at 2 and 4 processes against the same `single` run. So a process keeps the last few
references it ran and compares the next strategy with the same config against it, instead of
training it again.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path

import torch

from multigpu.config import ConfigError, RunConfig
from multigpu.launch import launch
from multigpu.runtime import device_plan

# how close a bf16-mixed run must stay to one device under the same autocast: the same arithmetic
# up to bf16 rounding (fp32 runs are held to the default tolerance of `check`)
BF16_TOLERANCE = 1e-3
KEPT_REFERENCES = 8  # the one-device runs a process keeps (their losses and trained weights)
_references: OrderedDict[str, tuple[list[float], dict]] = OrderedDict()


def _trained(cfg: RunConfig, progress: bool | None) -> tuple[list[float], dict, dict]:
    """(per-step losses, rank 0's trained weights, the record) of one run of `cfg`."""
    with tempfile.TemporaryDirectory(prefix="multigpu-check-") as tmp:
        path = Path(tmp, "params.pt")
        record = launch(cfg, params_path=path, progress=progress)
        return record["loss"], torch.load(path), record


def reference_run(reference: RunConfig, progress: bool | None = False) -> tuple[list[float], dict, dict]:
    """`_trained(reference)`, run once per config in this process and kept for the next
    `check` that compares with the same config."""
    key = reference.to_json()
    if key not in _references:
        _references[key] = _trained(reference, progress)
        while len(_references) > KEPT_REFERENCES:
            _references.popitem(last=False)
    _references.move_to_end(key)
    return _references[key]


def check(strategy: str, world_size: int, *, steps: int = 3, tolerance: float = 1e-5,
          progress: bool | None = False, **overrides) -> dict:
    """Return {'strategy', 'world_size', 'steps', 'max_abs_param_diff',
    'max_abs_loss_diff', 'tolerance', 'passed'}. `overrides` go to both RunConfigs."""
    base = dict(model="gpt-tiny", global_batch_size=8, steps=steps, optimizer="sgd-momentum",
                lr=0.05, dataset="synthetic", track_memory=False)
    base.update(overrides)
    cfg = RunConfig(strategy=strategy, world_size=world_size, **base).validate()
    # both runs on the same kind of device (the device plan's): on a 1-GPU machine the
    # N-process run falls back to the CPU, and the reference must not run on the GPU then
    try:
        device = device_plan(cfg).device
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cfg = cfg.replace(device=device)
    reference = cfg.replace(strategy="single", world_size=1, tp=1, pp=1, dp=None, grad_accum_steps=1, extra={})
    ours_loss, ours_params, ours = _trained(cfg, progress)
    ref_loss, ref_params, _ = reference_run(reference, progress)
    if ours_params.keys() != ref_params.keys():
        raise RuntimeError(f"{strategy} returned parameters {sorted(set(ours_params) ^ set(ref_params))} "
                           "that the single-device model does not have (or lacks them)")
    param_diff = max((ours_params[k].float() - ref_params[k].float()).abs().max().item() for k in ref_params)
    loss_diff = max(abs(a - b) for a, b in zip(ours_loss, ref_loss))
    return {
        "strategy": strategy,
        "world_size": world_size,
        "steps": steps,
        "max_abs_param_diff": param_diff,
        "max_abs_loss_diff": loss_diff,
        "tolerance": tolerance,
        "device": ours.get("provenance", {}).get("device_type"),  # where it ran (the reference: the same kind)
        "grid": ours["grid"],  # the rank grid its record states
        "passed": param_diff <= tolerance and loss_diff <= tolerance,
        "loss": ours_loss,
        "reference_loss": ref_loss,
    }
