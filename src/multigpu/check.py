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

from multigpu import moe
from multigpu.config import ConfigError, RunConfig
from multigpu.launch import LaunchError, launch, launch_series
from multigpu.runtime import device_plan
from multigpu.strategies.ep_scratch import moe_config

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


def parity_configs(strategy: str, world_size: int, steps: int = 3, **overrides) -> tuple[RunConfig, RunConfig]:
    """The strategy's run and its one-device reference: the same model, seed, global batches and
    steps (`overrides` go to both), on the same kind of device."""
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
    # a mixture of experts keeps its routing options, and its micro-batches: the balancing loss counts each
    # micro-batch's tokens, as it would on one device that accumulated gradients over the same ones
    routing = {k: v for k, v in cfg.extra.items() if k in moe.OPTIONS}
    accum = cfg.grad_accum_steps if moe_config(cfg.model) else 1
    return cfg, cfg.replace(strategy="single", world_size=1, tp=1, pp=1, cp=1, dp=None, ep=None,
                            grad_accum_steps=accum, extra=routing)


def compare(cfg: RunConfig, ours: tuple[list[float], dict, dict], reference: tuple[list[float], dict, dict],
            tolerance: float) -> dict:
    """The verdict: the largest differences of the trained weights and of the per-step losses (and
    for a mixture of experts, whether every layer routed and dropped the same tokens as one device)."""
    (ours_loss, ours_params, record), (ref_loss, ref_params, ref_record) = ours, reference
    if ours_params.keys() != ref_params.keys():
        raise RuntimeError(f"{cfg.strategy} returned parameters {sorted(set(ours_params) ^ set(ref_params))} "
                           "that the single-device model does not have (or lacks them)")
    param_diff = max((ours_params[k].float() - ref_params[k].float()).abs().max().item() for k in ref_params)
    loss_diff = max(abs(a - b) for a, b in zip(ours_loss, ref_loss))
    # a mixture of experts routes each token as one device does, in fp32; under bf16 autocast the router's
    # scores differ in their last bits with the batch's shape, and a near tie may choose the other expert
    routing = {k: record["moe"][k] == ref_record["moe"][k] for k in ("tokens_per_expert", "dropped")} \
        if "moe" in record and "moe" in ref_record else {}  # (a Hugging Face Mixtral on one device reports none)
    routing_counts = cfg.dtype == "fp32"
    return {
        "strategy": cfg.strategy,
        "world_size": cfg.world_size,
        "steps": cfg.steps,
        "max_abs_param_diff": param_diff,
        "max_abs_loss_diff": loss_diff,
        "tolerance": tolerance,
        "device": record.get("provenance", {}).get("device_type"),  # where it ran (the reference: the same kind)
        "grid": record["grid"],  # the rank grid its record states
        "passed": param_diff <= tolerance and loss_diff <= tolerance and (all(routing.values()) or not routing_counts),
        "loss": ours_loss,
        "reference_loss": ref_loss,
        **({"moe_same_routing": routing, "moe_dropped": sum(map(sum, record["moe"]["dropped"])),
            "reference_moe_dropped": sum(map(sum, ref_record["moe"]["dropped"]))} if routing else {}),
    }


def check(strategy: str, world_size: int, *, steps: int = 3, tolerance: float = 1e-5,
          progress: bool | None = False, **overrides) -> dict:
    """Return {'strategy', 'world_size', 'steps', 'max_abs_param_diff',
    'max_abs_loss_diff', 'tolerance', 'passed', ...}. `overrides` go to both RunConfigs."""
    cfg, reference = parity_configs(strategy, world_size, steps, **overrides)
    return compare(cfg, _trained(cfg, progress), reference_run(reference, progress), tolerance)


def check_series(cases: list[tuple[str, int, dict]], *, steps: int = 3, tolerance: float = 1e-5) -> list:
    """`check` of many (strategy, world_size, overrides) cases, each run of the same number of
    processes in one series (launch.launch_series: one torchrun for them all), the references
    likewise. Returns, per case, its result, or the exception `check` raises for it alone: a
    series that fails part-way gives the runs it finished, and every case after it is checked
    on its own, so that each failure is its own case's."""
    configs = [parity_configs(strategy, n, steps, **overrides) for strategy, n, overrides in cases]
    references = {ref.to_json(): ref for _, ref in configs if ref.to_json() not in _references}
    for device in sorted({ref.device for ref in references.values()}):  # a series runs on one kind of device: on
        # a machine of fewer GPUs than some cases' processes, their references run on the CPU, the others' on a GPU
        on_device = {key: ref for key, ref in references.items() if ref.device == device}
        for key, trained in zip(on_device, _run_series(list(on_device.values()))):
            _references[key] = trained
    while len(_references) > max(KEPT_REFERENCES, len(references)):
        _references.popitem(last=False)
    ours: dict[int, tuple] = {}
    for processes, device in sorted({(cfg.processes, cfg.device) for cfg, _ in configs}):
        indices = [i for i, (cfg, _) in enumerate(configs) if (cfg.processes, cfg.device) == (processes, device)]
        ours.update(zip(indices, _run_series([configs[i][0] for i in indices])))
    results = []
    for i, ((cfg, reference), (strategy, n, overrides)) in enumerate(zip(configs, cases)):
        try:
            results.append(compare(cfg, ours[i], reference_run(reference), tolerance) if i in ours
                           else check(strategy, n, steps=steps, tolerance=tolerance, **overrides))
        except Exception as err:  # the case's own failure, for its test to raise
            results.append(err)
    return results


def check_all(cases: list[tuple[str, int, dict]], *, steps: int = 3, tolerance: float = 1e-5) -> list[dict]:
    """`check` of every (strategy, world_size, overrides) case, in series (`check_series`): the
    results in order, or the first failing case's error, raised."""
    results = check_series(cases, steps=steps, tolerance=tolerance)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def _run_series(cfgs: list[RunConfig]) -> list[tuple[list[float], dict, dict]]:
    """(losses, trained weights, record) of each run of `cfgs`, run as one series; after a
    failure, of the runs before it only (the rest are left to `check`, one by one)."""
    if not cfgs:
        return []
    with tempfile.TemporaryDirectory(prefix="multigpu-check-") as tmp:
        try:
            records = launch_series(cfgs, params_dir=Path(tmp))
        except LaunchError as err:
            records = err.records
        return [(record["loss"], torch.load(Path(tmp, f"run{i}.pt")), record) for i, record in enumerate(records)]
