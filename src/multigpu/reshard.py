"""A checkpoint under the single-device names, whole: what lets any layout read any other's.

A canonical checkpoint (multigpu.checkpoint) already is one: DCP reads it under any layout. The
others are put together once, in one process, into a copy beside them (`step-N.canonical`):

- a local layout's (each rank's own pieces, saved with where each lies in the whole tensors:
  `strategies/state.py`'s places), every element of every tensor accounted for;
- DeepSpeed's engine files, through DeepSpeed's own universal checkpoint (`ds_to_universal`:
  every parameter's fp32 value, optimizer states and step count, whole).

`whole` reads a checkpoint's tensors whole in this process (the chapter, the tests, `export`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from multigpu.checkpoint_files import META, CheckpointError, checksum, files_of, flat_state, read_meta, resolve, verify
from multigpu.strategies.state import place_views, tensor_names


def whole(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A canonical checkpoint's weights and optimizer state, whole, read in this process (no process group:
    DCP's own conversion to one torch.save file), under flat names (`model.blocks.0.mlp.fc.weight`,
    `optimizer.blocks.0.mlp.fc.weight.exp_avg`; not the run's own state, whose generators are each rank's),
    and its meta.json."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = canonical_copy(path)
    meta = read_meta(path)
    verify(path, meta)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp, "whole.pt"))
        state = torch.load(Path(tmp, "whole.pt"), weights_only=False)
    # plain SGD keeps no optimizer state: its checkpoint holds the weights alone
    return flat_state({k: state[k] for k in ("model", "optimizer") if k in state}), meta


def canonical_copy(path: str | Path, make: bool = True) -> Path:
    """A checkpoint under the single-device names: `path` itself when it is one; for a local layout's
    (each rank's own pieces), a copy beside it (`step-N.canonical`, made once, in this process) whose
    tensors are put together whole from every rank's pieces by where each says it lies (`places`,
    strategies/state.py), every element of every tensor accounted for. DCP then reads it under any layout.
    make=False: the copy must be there already (a worker's rank other than 0 only reads the one made for it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = resolve(path)
    meta = read_meta(path)
    if meta["names"] == "canonical":
        return path
    out = path.with_name(path.name + ".canonical")
    if (out / META).exists():
        read_meta(out)
        return out
    if not make:
        raise CheckpointError(f"the canonical copy of {path} ({out.name}) is not there for this rank: the process "
                              "that made it writes beside the checkpoint, which every node must see (one shared "
                              "file system)")
    verify(path, meta)  # (the copy is made from the bytes that were written, or not at all)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp, "local.pt"))
        state = torch.load(Path(tmp, "local.pt"), weights_only=False)
        if meta["names"] == "deepspeed":
            shapes, tied = _shapes_and_ties(meta["config"]["model"])
            model, optimizer = _from_deepspeed(path, Path(tmp), shapes)
            for names in tied:  # a tied weight (and its state) under each of its names
                for found in (model, optimizer):
                    held = [found[n] for n in names if n in found]
                    for name in names:
                        if held:
                            found.setdefault(name, held[0])
            return _write_canonical(out, meta, model, optimizer, state["train"], path)
    wholes, covered = {}, {}
    for rank_key in sorted(k for k in state if re.fullmatch(r"rank\d+", k)):
        mine = state[rank_key]
        if "places" not in mine:
            raise CheckpointError(f"checkpoint {path} was saved by an earlier version of this package, before "
                                  "each rank wrote where its pieces lie: resume it with "
                                  f"--strategy {meta['config']['strategy']} and the same degrees, and save it again")
        pieces = flat_state({k: v for k, v in mine.items() if k != "places"})
        for key, found in json.loads(mine["places"]).items():
            piece = pieces[key].contiguous()
            for name, shape, how in found:
                whole = wholes.setdefault(name, torch.empty(shape, dtype=piece.dtype))
                seen = covered.setdefault(name, torch.zeros(shape, dtype=torch.bool))
                theirs, part = place_views(piece, whole, how)
                part.copy_(theirs)
                place_views(piece, seen, how)[1].fill_(True)
    holes = [name for name, seen in covered.items() if not seen.all()]
    if holes:
        raise CheckpointError(f"checkpoint {path}: no rank saved all of {', '.join(holes[:3])}"
                              f"{f' and {len(holes) - 3} more' if len(holes) > 3 else ''}; it cannot be read "
                              "under another layout")
    model = {k[len("model."):]: v for k, v in wholes.items() if k.startswith("model.")}
    optimizer: dict = {}
    for k, v in wholes.items():
        if k.startswith("optimizer."):
            name, key = k[len("optimizer."):].rsplit(".", 1)
            optimizer.setdefault(name, {})[key] = v
    return _write_canonical(out, meta, model, optimizer, state["train"], path)


def _write_canonical(out: Path, meta: dict, model: dict, optimizer: dict, train: dict, path: Path) -> Path:
    """Save whole tensors as a canonical checkpoint at `out` (aside, then renamed), described as `path`'s copy."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        # a writer that makes no CUDA call for host tensors (DCP's default copies ahead on the current CUDA stream)
        dcp.save({"model": model, "optimizer": optimizer, "train": train}, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(partial, per_thread_copy_ahead=0))
    files = files_of(partial)
    meta = {**meta, "names": "canonical", "files": files,
            "checksums": {name: checksum(partial / name) for name in files},
            "converted_from": {"strategy": meta["config"]["strategy"], "grid": meta["grid"], "path": str(path)}}
    (partial / META).write_text(json.dumps(meta, indent=1))
    os.replace(partial, out)
    return out


def _shapes_and_ties(model_name: str) -> tuple[dict[str, torch.Size], list[list[str]]]:
    """Every tensor's shape in the model, and the names that share one tensor (GPT-2's embedding and
    head): the model built on the meta device."""
    from multigpu.models import build_model

    with torch.device("meta"):
        model = build_model(model_name)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    return shapes, [group for group in tensor_names(model).values() if len(group) > 1]


def _from_deepspeed(path: Path, tmp: Path, shapes: dict[str, torch.Size]) -> tuple[dict, dict]:
    """(weights, optimizer state) of DeepSpeed's engine files, whole, under the model's names: DeepSpeed's own
    conversion to its universal checkpoint (`deepspeed.checkpoint.ds_to_universal`, one folder per parameter
    holding its fp32 value, each optimizer state and the step count), read back."""
    import subprocess
    import sys

    universal = tmp / "universal"
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(path / "engine"), "--output_folder", str(universal), "--num_extract_workers", "1",
                           "--num_merge_workers", "1", "--inject_missing_state"],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise CheckpointError(f"DeepSpeed could not convert {path} to its universal checkpoint: {last}")
    model, optimizer = {}, {}
    # the step count: per parameter for ZeRO-1/2; for ZeRO-3 in the optimizer's common state, one per group
    common = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=False) \
        if (universal / "zero" / "optimizer_state.pt").exists() else {}
    steps = {float(s["step"]): s["step"] for s in common.get("optimizer_state_dict", {}).get("state", {}).values()
             if "step" in s}
    for folder in sorted((universal / "zero").iterdir()):
        if not folder.is_dir():
            continue
        for file in folder.glob("*.pt"):
            value = torch.load(file, weights_only=False)
            value = value["param"] if isinstance(value, dict) else value
            if value.dim() and folder.name in shapes:  # ZeRO-3's come flat
                value = value.reshape(shapes[folder.name])
            if file.stem == "fp32":
                model[folder.name] = value
            else:
                optimizer.setdefault(folder.name, {})[file.stem] = value
    for state in optimizer.values():
        if "step" not in state and len(steps) == 1:
            state["step"] = next(iter(steps.values())).clone()
    return model, optimizer


def whole_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A canonical checkpoint's weights, whole, under the single-device names, and its meta.json."""
    tensors, meta = whole(path)
    return {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}, meta
