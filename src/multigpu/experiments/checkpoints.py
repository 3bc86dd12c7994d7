"""The experiments of chapter "Checkpoints and failures": what a checkpoint weighs on every rank under
each strategy, beside the model-state formula; and what saving costs a run, blocking and in the
background, beside the same run saving nothing (A B A B).

Every run saves into a folder of its own that is deleted after it (the record keeps what the saves
cost and wrote); its config says `checkpoint_dir: "<temporary>"`.
"""

from __future__ import annotations

import shutil
import tempfile

from multigpu.config import RunConfig
from multigpu.experiments.machine import Job, on_gpus


def _saved(cfg: RunConfig) -> list[dict]:
    """Run `cfg` saving into a temporary folder; its record, the folder gone."""
    from multigpu.launch import launch

    folder = tempfile.mkdtemp(prefix="multigpu-ckpt-")
    try:
        record = launch(cfg.replace(checkpoint_dir=folder) if cfg.checkpoint_dir else cfg, progress=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if cfg.checkpoint_dir:
        record["config"]["checkpoint_dir"] = "<temporary>"
    return [record]


def _job(cfg: RunConfig, name: str) -> Job:
    return Job(name, lambda: _saved(cfg))


# the strategies whose checkpoints differ in what each rank writes: whole on one rank, or cut in four
BYTES_STRATEGIES = (("single", 1, {}), ("ddp", 4, {}), ("zero1", 4, {}), ("zero3", 4, {}), ("fsdp", 4, {}),
                    ("fsdp", 4, {"tp": 2}), ("tp-scratch", 2, {}), ("tp", 2, {}), ("pp-1f1b", 2, {}),
                    ("deepspeed-zero3", 4, {}))


def checkpoint_bytes() -> list[Job]:
    """gpt-small (6 blocks, AdamW) trained 2 steps by each strategy, saved after the last:
    the bytes every rank wrote (on the CPU on every machine, 4 processes: a layout, not a speed)."""
    base = RunConfig(model="gpt-small", global_batch_size=8, grad_accum_steps=2, optimizer="adamw", lr=1e-3,
                     steps=2, track_memory=False, device="cpu", checkpoint_dir="<temporary>")
    return [_job(base.replace(strategy=s, world_size=n, **over),
                 f"bytes {s} x{n}" + "".join(f" {k}{v}" for k, v in over.items()))
            for s, n, over in BYTES_STRATEGIES]


SAVE_MODES = ("none", "blocking", "async")


def checkpoint_cost() -> list[Job]:
    """One device (the GPU if there is one: gpt2, 124M parameters; else gpt-small) trained saving twice,
    halfway and at the end, blocking and in the background, beside the same run saving nothing, alternated
    twice. Halfway is a few seconds of training after the first save (120 steps on the GPU, 12 on the
    CPU): about as long as writing a checkpoint there takes, so that the background write can hide."""
    model, steps = ("gpt2", 120) if on_gpus(1) else ("gpt-small", 12)
    base = RunConfig(model=model, global_batch_size=8, optimizer="adamw", lr=1e-4, steps=steps,
                     track_memory=False, dataset="dummy")
    jobs = []
    for repeat in range(2):
        for mode in SAVE_MODES:
            cfg = base.replace(extra={"repeat": repeat}) if mode == "none" else base.replace(
                checkpoint_dir="<temporary>", checkpoint_every=steps // 2, checkpoint_async=mode == "async",
                extra={"repeat": repeat})
            jobs.append(_job(cfg, f"cost {model} {mode} {repeat}"))
    return jobs
