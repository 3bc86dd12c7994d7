"""Checkpoints: what a run has learned, saved every N steps, and a run resumed from it exactly.

A checkpoint is a folder `DIR/step-00000010` holding everything the next step depends on:

- the weights and the optimizer's state (momentum, Adam's two moments and its step count),
  each rank writing the part it holds (PyTorch's distributed checkpoint, DCP: one file per
  rank and a `.metadata` index of which rank wrote which piece of which tensor);
- the data position (steps done: the sampler's order is a function of the seed, the epoch
  and the global batch, so the steps done say where the data stand), every rank's random
  number generators, fp16's loss scale, and the losses so far;
- `meta.json`: the run's config and grid, how the tensors are named, its model known by content
  (`checkpoint_guard.model_identity`), and every rank's file with its size and checksum, written last.

How a strategy's state is named decides where it can be loaded again:

- "canonical": every tensor under the single-device model's name (`blocks.0.mlp.fc.weight`),
  whole or as DTensor shards that say where in the whole tensor they lie. DCP then loads it
  under any other layout of the same model (FSDP on 4 ranks into TP x DP, a pipeline, one
  device): each rank reads the pieces it needs. Replicated tensors (DDP's) are written once.
- "local": a strategy that cuts tensors its own way into plain tensors (the from-scratch
  ZeRO's flat shards, tp-scratch's slices, ep-scratch's rows of experts) saves each rank's
  pieces under the rank's own keys, with where each lies in the whole tensors (`places`): the
  same layout reads them back as they are; any other reads `canonical_copy`, the whole tensors
  put together from every rank's pieces once, beside the checkpoint.
- "deepspeed": DeepSpeed's engine saves itself (`engine.save_checkpoint`), beside our state;
  DeepSpeed reads it back with the same degrees, and any other layout through `canonical_copy`
  (DeepSpeed's universal checkpoint, read whole); DeepSpeed takes a canonical checkpoint whole
  (`Parallelized.load_whole`: strategies.deepspeed.put_whole). deepspeed-moe's stay its own.

A strategy says which (`Parallelized.checkpoint_names`); the names themselves are made in
`strategies/state.py` (`checkpoint_state`), beside the code that gathers a strategy's whole weights.

A save writes into `step-N.partial` and renames it to `step-N` only when every rank's file
and `meta.json` are there: a run killed during a save leaves the previous checkpoint whole,
and a folder without `meta.json`, or whose files are missing, short or changed (their checksums), is refused
by name (before any worker starts: multigpu.checkpoint_guard, which the launcher calls).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from multigpu.checkpoint_files import (  # noqa: F401 - the folder's names, read through this module too
    FORMAT,
    META,
    CheckpointError,
    _rank_of,
    checksum,
    complete,
    damaged,
    files_of,
    flat_state,
    owner,
    read_meta,
    resolve,
    step_dir,
    verify,
)
from multigpu.checkpoint_guard import (  # noqa: F401 - read through this module too
    SAME_RUN,
    compatibility_problems,
    model_identity,
    needs_canonical_copy,
    same_layout,
)
from multigpu.reshard import canonical_copy, whole, whole_weights  # noqa: F401 - read through this module too
from multigpu.strategies.state import (
    checkpoint_state,
    checkpoint_targets,
    fill_local,
    local_tensor,
    put_back_checkpoint_state,
)

# where a save can be cut short: before anything is written; after the ranks' files (no meta.json);
# after meta.json (not yet renamed); after the rename (complete). Tests kill a rank at each.
SAVE_STAGES = ("start", "written", "described", "renamed")


def train_state(rank: int, steps_done: int, losses: list[float], scaler, device: torch.device) -> dict:
    """The rest of what the next step depends on: where the data stand, the random generators, the loss
    scale (fp16-mixed), and the losses so far (for the record)."""
    state = {"steps_done": torch.tensor(steps_done), f"losses_rank{rank}": torch.tensor(losses, dtype=torch.float64),
             f"rng_rank{rank}": torch.get_rng_state(),
             "loss_scaler": json.dumps({"scaler": scaler.scaler.state_dict(), **scaler.report()} if scaler else None)}
    if device.type == "cuda":
        state[f"cuda_rng_rank{rank}"] = torch.cuda.get_rng_state(device)
    return state


def _train_targets(rank: int, device: torch.device, saved: dict) -> dict:
    """What dcp.load fills for the train state: this rank's generators only where the saving run had this
    rank (a checkpoint loaded by more ranks than saved it leaves the new ranks' generators as they are)."""
    saved_keys = set(saved)
    # every saving rank's losses (a rank's own loss differs: each averages its own samples)
    state = {"steps_done": torch.zeros((), dtype=torch.long), "loss_scaler": "",
             **{key[len("train."):]: torch.empty(meta.size, dtype=torch.float64) for key, meta in saved.items()
                if key.startswith("train.losses_rank")}}
    if f"train.rng_rank{rank}" in saved_keys:
        state[f"rng_rank{rank}"] = torch.get_rng_state()
    if device.type == "cuda" and f"train.cuda_rng_rank{rank}" in saved_keys:
        state[f"cuda_rng_rank{rank}"] = torch.cuda.get_rng_state(device)
    return state


# -- saving ----------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves a run's state every `cfg.checkpoint_every` steps (and after its last step) into
    `cfg.checkpoint_dir`, blocking or in the background (`checkpoint_async`: the state is copied to host
    memory while training waits, then written by a thread while training goes on; the folder is finished,
    renamed, at the next save or at the end). Every rank calls every method, in the same order."""

    def __init__(self, cfg, rt, par, fault=None):
        self.cfg, self.rt, self.par, self.fault = cfg, rt, par, fault or (lambda stage, step: None)
        self.root = Path(cfg.checkpoint_dir)
        # the checkpoint's own gloo group: its collectives may run on a background thread (async), beside the
        # training's, and DCP exchanges its plans as Python objects, which gloo carries on any device
        self.group = dist.new_group(backend="gloo")
        self.buffers: dict[str, torch.Tensor] = {}  # async: the host copies of the state, made once, reused
        self.staged: dict[str, DTensor] = {}  # async: a DTensor's spec around its host buffer, made once
        self.pending: tuple | None = None  # (step, folder, future, start, staging_s) of a save in flight
        self.saves: list[dict] = []  # what each save cost: for the record

    def due(self, steps_done: int) -> bool:
        every = self.cfg.checkpoint_every
        return (every is not None and steps_done % every == 0) or steps_done == self.cfg.steps

    def save(self, steps_done: int, losses: list[float]) -> None:
        self.finish()
        start = time.perf_counter()
        final = step_dir(self.root, steps_done)
        folder = final.with_name(final.name + ".partial")
        if self.rt.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)  # an earlier save of this step, cut short
            folder.mkdir(parents=True)
        dist.barrier(group=self.group)
        self.fault("start", steps_done)
        if self.par.checkpoint_names == "deepspeed":
            state = {}
            self.par.module.save_checkpoint(str(folder), tag="engine")  # the engine's own, every rank
        else:
            state = checkpoint_state(self.par, self.rt.rank)[0]
        state["train"] = train_state(self.rt.rank, steps_done, losses, self.par.scaler, self.rt.device)
        if self.cfg.checkpoint_async:
            # the writer thread gets host tensors only, and a writer that makes no CUDA call for them: DCP's
            # default copies ahead on the thread's current CUDA stream, and a new thread's device is GPU 0
            # on every rank (torch's FileSystemWriter.stage sets the same 0, for its own stager)
            writer = dcp.FileSystemWriter(folder, per_thread_copy_ahead=0)
            future = dcp.async_save(self._staged(state), storage_writer=writer, process_group=self.group,
                                    async_stager=_AlreadyStaged())
            self.pending = (steps_done, folder, future, start, time.perf_counter() - start)
        else:
            dcp.save(state, checkpoint_id=folder, process_group=self.group)
            self.pending = (steps_done, folder, None, start, None)
            self.finish()

    def finish(self) -> None:
        """Finish the save in flight: wait for its files, then describe it and rename it into place."""
        if self.pending is None:
            return
        steps_done, folder, future, start, staging_s = self.pending
        self.pending = None
        waited = time.perf_counter()
        if future is not None:
            future.result()
        waited_s = time.perf_counter() - waited  # training stood still for the write it had not finished
        self.fault("written", steps_done)
        dist.barrier(group=self.group)  # every rank's files are written
        final = step_dir(self.root, steps_done)
        files = files_of(folder)
        # each rank checksums the files it wrote (still in its page cache), rank 0 the others (DCP's index)
        sums: list = [None] * self.rt.world_size
        dist.all_gather_object(sums, {name: checksum(folder / name) for name in files
                                      if owner(name, self.rt.world_size) == self.rt.rank}, group=self.group)
        if self.rt.rank == 0:
            meta = {"format": FORMAT, "steps_done": steps_done, "names": self.par.checkpoint_names,
                    "config": self.cfg.to_dict(), "grid": self.cfg.grid.as_dict(), "world_size": self.rt.world_size,
                    "same_run": {k: getattr(self.cfg, k) for k in SAME_RUN},
                    "model_identity": model_identity(self.cfg.model), "files": files,
                    "checksums": {name: digest for part in sums for name, digest in part.items()},
                    "saved_unix": time.time()}
            with open(folder / META, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        self.fault("described", steps_done)
        dist.barrier(group=self.group)
        if self.rt.rank == 0:
            old = final.with_name(final.name + ".old")
            if final.exists():  # the same step saved again (a restarted run): swap, then drop the old one
                os.replace(final, old)
            os.replace(folder, final)
            shutil.rmtree(old, ignore_errors=True)
        self.fault("renamed", steps_done)
        if self.rt.rank == 0 and self.cfg.checkpoint_keep:
            for stale in complete(self.root)[:-self.cfg.checkpoint_keep]:
                shutil.rmtree(stale, ignore_errors=True)
                shutil.rmtree(stale.with_name(stale.name + ".canonical"), ignore_errors=True)  # its copy, if made
        dist.barrier(group=self.group)
        now = time.perf_counter()
        by_rank = [0] * self.rt.world_size
        for name, size in files.items():
            if (r := _rank_of(Path(name).name)) is not None and r < len(by_rank):
                by_rank[r] += size
        # blocking: the time training stood still for this save (async: the copy to host memory, the wait for a
        # write not yet finished at the next save, and the rename); total: from its start to its rename
        self.saves.append({"steps_done": steps_done, "async": future is not None,
                           "blocking_s": (now - start) if future is None else staging_s + (now - waited),
                           "staging_s": staging_s, "waited_s": waited_s if future is not None else None,
                           "total_s": now - start, "bytes_total": sum(files.values()), "bytes_by_rank": by_rank})

    def _staged(self, state: dict, prefix: str = "") -> dict:
        """A private host copy of `state` for the background write, while training changes the original:
        every tensor copied into a host buffer made at the first save and reused at every later one (on a
        GPU page-locked, so that the copy runs at the link's speed). A DTensor keeps its spec (mesh, placement,
        where its piece lies in the whole tensor) around the buffer itself, as torch's own stager builds it
        (`_state_dict_utils._create_cpu_state_dict`): DTensor.from_local would move the buffer back onto the
        mesh's device, a second GPU copy of the state."""
        out = {}
        for key, value in state.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                out[key] = self._staged(value, name + ".")
                continue
            if not isinstance(value, torch.Tensor):
                out[key] = value
                continue
            local = local_tensor(value)
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = self.buffers[name] = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                                          pin_memory=local.is_cuda)
                self.staged.pop(name, None)
            buffer.copy_(local.detach(), non_blocking=local.is_cuda)
            if isinstance(value, DTensor):
                staged = self.staged.get(name)
                if staged is None or staged._spec != value._spec:
                    staged = self.staged[name] = DTensor(buffer, value._spec, requires_grad=False)
                out[key] = staged
            else:
                out[key] = buffer
        if not prefix and self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)  # every copy landed before the writer reads the buffers
        return out

    def close(self) -> None:
        """Finish the last save; free the host buffers."""
        self.finish()
        self.buffers.clear()
        self.staged.clear()


class _AlreadyStaged(AsyncStager):
    """For dcp.async_save: the state handed over is already a private host copy (`Checkpointer._staged`);
    nothing to wait for or to free (AsyncStager's synchronize_staging and close do nothing)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict


# -- loading ---------------------------------------------------------------------------------------------


def load(path: str | Path, par, cfg, rt) -> dict:
    """Load a checkpoint into a prepared strategy; return the train state: "steps_done", "losses" (the saved
    run's record), "rank_losses" (this rank's, which its training goes on from), where it came from."""
    path = resolve(path)
    meta = read_meta(path)
    problems = compatibility_problems(meta, cfg)
    if problems:
        raise CheckpointError(f"cannot continue from {path}: " + "; ".join(problems))
    names = par.checkpoint_names
    layout_kept = names == meta["names"] and same_layout(meta, cfg)
    if meta["names"] in ("local", "deepspeed") and not layout_kept:
        # another layout reads a local one (or DeepSpeed's) through its canonical copy: the launcher made it
        # before the workers started (checkpoint_guard); where it did not, rank 0 makes it while the others
        # wait on a gloo group with a timeout of hours (a conversion can outlast NCCL's 300 s), then only read it
        group = dist.new_group(backend="gloo", timeout=timedelta(hours=2))
        if rt.rank == 0:
            canonical_copy(path)
        dist.barrier(group=group)
        dist.destroy_process_group(group)
        path = canonical_copy(path, make=False)
        meta = read_meta(path)
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as err:  # (DCP's own is a BaseException)
        raise damaged(path, f".metadata cannot be read ({type(err).__name__})") from None
    # DeepSpeed from a canonical checkpoint: every whole tensor read on every rank, then handed to the engine
    whole_for_deepspeed = names == "deepspeed" and meta["names"] == "canonical"
    if whole_for_deepspeed and par.load_whole is None:
        raise CheckpointError(f"cannot continue from {path}: {cfg.strategy} reads only its own engine files")
    state, how = ({}, {}) if names == "deepspeed" else checkpoint_targets(par, rt.rank)
    if whole_for_deepspeed:
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()
                 if k.startswith(("model.", "optimizer.")) and hasattr(m, "size")}
    for mine in state.values():  # where a local layout's pieces lie: written for other layouts, not read back
        if isinstance(mine, dict):
            mine.pop("places", None)
    wholes = None
    if names == "local" and meta["names"] == "canonical":  # this rank's pieces, cut from the whole tensors
        pieces = flat_state(how["state"])
        wholes = {name: torch.empty(shape, dtype=pieces[key].dtype, device="cpu")
                  for key, found in how["places"].items() for name, shape, _ in found}
        state = dict(wholes)
    state["train"] = _train_targets(rt.rank, rt.device, saved)
    wanted = list(flat_state(state))
    missing = [k for k in wanted if k not in saved]
    if names == "local" and wholes is None:  # a rank's own pieces: every one it saved has a place now
        missing += [f"a place for {k}" for k in saved if k.startswith(f"rank{rt.rank}.") and k not in wanted
                    and not k.endswith(".places")]
    if missing:
        raise CheckpointError(f"cannot continue from {path}: it lacks {', '.join(missing[:3])}"
                              f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}, which this run "
                              f"({cfg.strategy}, grid {cfg.grid.as_dict()}) holds; it was saved by "
                              f"{meta['config']['strategy']} on grid {meta['grid']}")
    if names == "deepspeed" and not whole_for_deepspeed:
        loaded, _ = par.module.load_checkpoint(str(path), tag="engine", load_lr_scheduler_states=False)
        if loaded is None:
            raise CheckpointError(f"cannot continue from {path}: DeepSpeed found no engine state in it")
    try:
        dcp.load(state, checkpoint_id=path, process_group=dist.group.WORLD)
    except (Exception, CheckpointException) as err:  # a file damaged at its size, saved before checksums
        failures = getattr(err, "failures", None)
        what = f"on ranks {sorted(failures)}: {type(next(iter(failures.values()))[0]).__name__}" if failures \
            else (str(err).strip().splitlines() or [""])[0][:120]
        raise damaged(path, f"DCP could not read it ({type(err).__name__} {what})") from err
    if wholes is not None:
        fill_local(how["state"], how["places"], wholes)
    elif whole_for_deepspeed:
        par.load_whole(state)
    elif names != "deepspeed":
        put_back_checkpoint_state(par, state, how)
    train = state["train"]
    for key, value in train.items():
        if key.startswith("rng_rank"):
            torch.set_rng_state(value)
        elif key.startswith("cuda_rng_rank"):
            torch.cuda.set_rng_state(value, rt.device)
    scaler = json.loads(train["loss_scaler"]) if train["loss_scaler"] else None
    if scaler and par.scaler is not None:
        par.scaler.scaler.load_state_dict(scaler["scaler"])
        par.scaler.scale_by_step[:] = scaler["loss_scale_by_step"]
        par.scaler.skipped_steps[:] = scaler["skipped_steps"]
    by_rank = {int(k[len("losses_rank"):]): v.tolist() for k, v in train.items() if k.startswith("losses_rank")}
    # the saved run's losses as its record has them: the mean over all its ranks (worker.build_record)
    ranks = [by_rank[r] for r in sorted(by_rank)]
    run_losses = [sum(r[s] for r in ranks) / len(ranks) for s in range(len(ranks[0]))]
    return {"steps_done": int(train["steps_done"]), "losses": run_losses, "path": str(path), "names": meta["names"],
            "saved_by": {"strategy": meta["config"]["strategy"], "grid": meta["grid"]},
            # this rank's own, under the same layout (a rank's loss averages its own samples); under another,
            # the saved run's, so that the new record's restored steps are the saved record's
            "rank_losses": by_rank[rt.rank] if layout_kept else list(run_losses)}
