"""The experiments of chapter "One device": what one device holds, and what the estimator's
"will it fit" is calibrated with."""

from __future__ import annotations

from multigpu.config import RunConfig
from multigpu.experiments.machine import on_gpus


def one_device_memory() -> list[RunConfig]:
    """Memory of one device by optimizer, batch size and sequence length."""
    model, batch, seq = ("gpt2", 8, 256) if on_gpus() else ("gpt-small", 2, 64)
    base = RunConfig(model=model, global_batch_size=batch, seq_len=seq, steps=6, dataset="dummy")
    runs = [base.replace(optimizer=o) for o in ("sgd", "sgd-momentum", "adamw")]
    runs += [base.replace(global_batch_size=b, extra={"sweep": "batch"}) for b in (1, 2, 4, 8, 16)]
    runs += [base.replace(seq_len=s, extra={"sweep": "seq_len"}) for s in (32, 64, 128, 256)]
    return runs


def one_device_techniques() -> list[RunConfig]:
    """What mixed precision (bf16, and fp16 with loss scaling), activation checkpointing and
    accumulation change."""
    model, batch, seq = ("gpt2", 16, 512) if on_gpus() else ("gpt-small", 8, 128)
    base = RunConfig(model=model, global_batch_size=batch, seq_len=seq, steps=10, optimizer="adamw",
                     dataset="dummy")
    return [
        base.replace(extra={"technique": "baseline"}),
        base.replace(dtype="bf16-mixed", extra={"technique": "bf16-mixed"}),
        base.replace(dtype="fp16-mixed", extra={"technique": "fp16-mixed"}),
        base.replace(activation_checkpointing=True, extra={"technique": "activation checkpointing"}),
        base.replace(grad_accum_steps=2, extra={"technique": "accumulation x2"}),
        base.replace(grad_accum_steps=4, extra={"technique": "accumulation x4"}),
    ]


def machine_peak() -> list[RunConfig]:
    """The tracker's peak beside the machine's own (the resident set on a CPU, the caching
    allocator on a GPU) for models of real size in one process, GPT and T5 (as released,
    dropout on): what the estimator's "will it fit" is calibrated with
    (multigpu.estimator.accuracy.machine_calibration)."""
    scale = 4 if on_gpus() else 1
    runs = [RunConfig(model="gpt2", global_batch_size=b * scale, seq_len=256, steps=4, optimizer="adamw",
                      dataset="dummy") for b in (1, 2, 4)]
    runs += [RunConfig(model="t5-small", global_batch_size=b * scale, seq_len=256, steps=4,
                       optimizer="sgd-momentum", dataset="dummy") for b in (2, 4)]
    runs.append(RunConfig(model="t5-base", global_batch_size=2 * scale, seq_len=256, steps=4,
                          optimizer="sgd-momentum", dataset="dummy"))
    return runs
