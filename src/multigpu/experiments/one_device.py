"""The experiments of chapter "One device": what one device holds, and what the estimator's
"will it fit" is calibrated with."""

from __future__ import annotations

from multigpu.config import RunConfig
from multigpu.experiments.machine import Job, on_gpus


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
    (multigpu.estimator.accuracy.machine_calibration). On a GPU also the GPT-2 sizes and
    T5-large, in fp32 and under bf16 autocast: the estimator against the allocator's
    allocated and reserved peaks, run by run."""
    scale = 4 if on_gpus() else 1
    runs = [RunConfig(model="gpt2", global_batch_size=b * scale, seq_len=256, steps=4, optimizer="adamw",
                      dataset="dummy") for b in (1, 2, 4)]
    runs += [RunConfig(model="t5-small", global_batch_size=b * scale, seq_len=256, steps=4,
                       optimizer="sgd-momentum", dataset="dummy") for b in (2, 4)]
    runs.append(RunConfig(model="t5-base", global_batch_size=2 * scale, seq_len=256, steps=4,
                          optimizer="sgd-momentum", dataset="dummy"))
    if on_gpus():
        sizes = [("gpt2", 8, "adamw"), ("gpt2-medium", 8, "adamw"), ("gpt2-large", 4, "adamw"),
                 ("t5-large", 4, "sgd-momentum")]
        runs += [RunConfig(model=m, global_batch_size=b, seq_len=256, steps=4, optimizer=o, dtype=d, dataset="dummy")
                 for m, b, o in sizes for d in ("fp32", "bf16-mixed") if (m, d) != ("gpt2", "fp32")]
    return runs


# the sources' card (multigpu.sources.T5_GPU): a GPU run caps the process's allocator at its size
SOURCES_CARD_BYTES = 32 * 2**30
CPU_STAND_IN = ("t5-small", 2 * 2**30)  # on a CPU: T5-large would take hours; a stand-in and a cap of its size


def t5_as_the_sources(model: str, cap_bytes: int, attention: str) -> RunConfig:
    """The sources' T5 run (multigpu.sources.T5_SETTING) with `attention`, its batch left to the search."""
    from multigpu.sources import T5_SETTING

    extra = {"attention": attention}
    if on_gpus():
        extra["cuda_memory_cap_bytes"] = cap_bytes  # past it the allocator raises out of memory, as a 32 GB card
    return RunConfig(model=model, seq_len=T5_SETTING["seq_len"], dtype=T5_SETTING["dtype"],
                     optimizer=T5_SETTING["optimizer"], lr=0.01, dataset="dummy",
                     device="cuda" if on_gpus() else "cpu", extra=extra)


def _t5_largest_batch_records(model: str, cap_bytes: int, attention: str) -> list[dict]:
    from multigpu.maxbatch import measure_largest_batch

    cfg = t5_as_the_sources(model, cap_bytes, attention)
    found = measure_largest_batch(cfg, cap_bytes)
    if found["provenance"] is None:
        raise RuntimeError(f"t5_largest_batch: not one {model} run ({attention}) finished under "
                           f"{cap_bytes / 2**30:.0f} GiB")
    return [{"config": cfg.to_dict(), "grid": cfg.grid.as_dict(), **found,
             "probes": {str(k): v for k, v in found["probes"].items()}}]


def t5_largest_batch() -> list[Job]:
    """The sources' single-GPU question (multigpu.sources: T5-large as released, fp32, SGD with
    momentum, 256 tokens in and 256 out, one 32 GB V100): the largest batch that trains, found
    by real runs, with attention computed operation by operation as transformers did in 2022
    (eager) and in one fused call as it does today (SDPA). On a GPU the process's caching
    allocator is capped at 32 GiB (torch.cuda.set_per_process_memory_fraction), so a batch
    fits when it trains without running out of memory. On a CPU, where T5-large would take
    hours, t5-small stands in, its tracked peak against a cap of 2 GiB."""
    model, cap = ("t5-large", SOURCES_CARD_BYTES) if on_gpus() else CPU_STAND_IN
    return [Job(f"{model} {attention}, cap {cap / 2**30:.0f} GiB", _t5_largest_batch_records,
                dict(model=model, cap_bytes=cap, attention=attention)) for attention in ("eager", "sdpa")]
