"""What is checked about checkpoints before any worker starts, and what is prepared for them.

- Does a checkpoint fit this run (`compatibility_problems`): the same model, known by its content (a
  preset's name, or a config.json's settings: the same file under another path is the same model, a file
  edited since the save is not), the same data, the same optimizer, steps left to train.
- Is it whole (`checkpoint_files.verify`): every file's checksum, DCP's index readable.
- Can the run save at all: its `--checkpoint-dir` is made and written to once (a probe file), so that a
  folder it cannot write is refused now, not at the first save after the training before it.
- Another layout reads a local or DeepSpeed checkpoint through its canonical copy (multigpu.reshard):
  the launcher makes it here, once, before the workers start, so that no rank waits for it inside a
  collective whose timeout is NCCL's.

`before_launch` does all of it; `launch` calls it (RunConfig.validate checks the fit as well).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from multigpu.checkpoint_files import CheckpointError, read_meta, resolve, skipped, verify
from multigpu.errors import ConfigError

# what must match between the run that saved and the run that loads: the same model, trained on the same
# data in the same order, by the same optimizer (the layout may differ where the names are canonical)
SAME_RUN = ("model", "optimizer", "global_batch_size", "seq_len", "dataset", "num_samples", "seed")


def model_identity(name: str) -> str:
    """What a checkpoint says its model is: a preset's name, or a config.json's settings (a hash of the
    parsed file, so that its path and its spacing do not matter, and any changed setting does)."""
    from multigpu.models import PRESETS, read_config_file

    if name in PRESETS:
        return name
    settings = json.dumps(read_config_file(name), sort_keys=True).encode()
    return "config.json " + hashlib.blake2b(settings, digest_size=8).hexdigest()


def _model_problem(meta: dict, cfg) -> str | None:
    saved, here = meta["same_run"]["model"], cfg.model
    if "model_identity" not in meta:  # saved before models were known by content: by name, as then
        return None if saved == here else f"model {saved!r} (this run: {here!r})"
    if meta["model_identity"] == model_identity(here):
        return None
    if here.endswith(".json") and os.path.abspath(saved) == os.path.abspath(here):
        return (f"model {saved!r} with other settings: that file was edited after the save (restore its settings, "
                "or start a new run without --resume)")
    return f"model {saved!r} (this run: {here!r}{', whose settings differ' if here.endswith('.json') else ''})"


def compatibility_problems(meta: dict, cfg) -> list[str]:
    """Why a run with `cfg` cannot continue from a checkpoint described by `meta` (empty: it can)."""
    problems = [p for p in [_model_problem(meta, cfg)] if p]
    problems += [f"{k} {meta['same_run'][k]!r} (this run: {getattr(cfg, k)!r})" for k in SAME_RUN[1:]
                 if meta["same_run"][k] != getattr(cfg, k)]
    if problems:
        hint = "" if "num_samples" not in str(problems) else (
            " (the data set is --dataset-size samples, or about 16,000 tokens whatever the steps: give both "
            "runs the same --dataset-size, or leave it out in both)")
        return [f"it was saved by a run with {', '.join(problems)}: the weights or the data would not continue{hint}"]
    if meta["steps_done"] > cfg.steps or (meta["steps_done"] == cfg.steps and not cfg.checkpoint_dir):
        return [f"it holds {meta['steps_done']} steps done and this run asks for steps={cfg.steps}: nothing to "
                f"train; give more steps than {meta['steps_done']} (or as many, with a checkpoint_dir, to save it "
                "again under this run's layout)"]
    if meta["names"] == "deepspeed" and not same_layout(meta, cfg):
        if meta["config"]["strategy"] == "deepspeed-moe":
            return [f"it was saved by deepspeed-moe on grid {meta['grid']}, whose experts are DeepSpeed-MoE's "
                    "modules under the library's names: only deepspeed-moe with the same degrees reads it"]
    if cfg.info.module == "deepspeed_moe" and not (meta["names"] == "deepspeed" and same_layout(meta, cfg)):
        return [f"deepspeed-moe holds its experts as DeepSpeed-MoE's modules and reads only its own engine files, "
                f"with the same degrees; this checkpoint was saved by {meta['config']['strategy']} on grid "
                f"{meta['grid']}: continue it with ep-scratch, fsdp --ep or single"]
    return []


def same_layout(meta: dict, cfg) -> bool:
    return meta["config"]["strategy"] == cfg.strategy and meta["grid"] == cfg.grid.as_dict()


def needs_canonical_copy(meta: dict, cfg) -> bool:
    """A local layout's checkpoint (or DeepSpeed's) read by another layout: through its canonical copy."""
    return meta["names"] in ("local", "deepspeed") and not same_layout(meta, cfg)


def check_writable(folder: str | Path) -> None:
    """Make the checkpoint folder and write a probe file into it: a folder this run cannot write (a read-only
    mount, a path under a file, no permission) is refused before the training it would otherwise lose."""
    folder = Path(folder)
    probe = folder / f".multigpu-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"checkpoint_dir {folder} cannot be written ({err.strerror or type(err).__name__}"
                          f"{f': {err.filename}' if err.filename else ''}), so no checkpoint could be saved; "
                          "give --checkpoint-dir a folder this user can write") from None


def before_launch(cfg, node_rank: int = 0) -> None:
    """Before any worker starts: the checkpoint to resume from is whole (checksums) and, for another layout, has
    its canonical copy (made by node 0's launcher); the folder to save into can be written. Says which newer
    step folders were passed over as incomplete."""
    if cfg.resume is not None:
        path = resolve(cfg.resume)
        passed_over = skipped(cfg.resume, path)
        if passed_over:
            print(f"multigpu: resuming from {path}; passed over {', '.join(passed_over)} (newer, but without "
                  "meta.json: a save cut short)", file=sys.stderr, flush=True)
        meta = read_meta(path)
        verify(path, meta)
        problems = compatibility_problems(meta, cfg)
        if problems:
            raise CheckpointError(f"cannot continue from {path}: " + "; ".join(problems))
        if needs_canonical_copy(meta, cfg) and node_rank == 0:
            from multigpu.reshard import canonical_copy

            copy = canonical_copy(path)
            verify(copy, read_meta(copy))
    if cfg.checkpoint_dir is not None:
        check_writable(cfg.checkpoint_dir)


def checkpoint_refusal(out_dir: Path) -> CheckpointError | None:
    """The CheckpointError a worker raised (a checkpoint found damaged or unfit while loading it), as the
    launcher's own one-line error, without the ranks' tracebacks: the cause is the checkpoint, not the code."""
    for path in sorted(out_dir.glob("error-rank*.txt")):
        summary = path.read_text().partition("\n")[0]
        if summary.startswith("CheckpointError: "):
            return CheckpointError(summary.removeprefix("CheckpointError: "))
    return None
