"""The registry of the experiments behind the book's figures, and the runner that keeps their
records: what `make figures` runs.

An experiment is a list of training runs (RunConfigs), sized for the machine at hand: small
presets on a CPU (gloo, a few processes), GPT-2 sizes on CUDA GPUs (NCCL); or a list of
`Job`s, measurements that are not training runs (collective benchmarks, a replay of stale
gradients), each returning its own records. Records go to
results/<machine-tag>/<experiment>.jsonl. The file is rewritten after every run, always
whole (write aside, then rename), so an interrupted sweep keeps the runs that finished and
never leaves a half-written line; other machines' folders are never touched.
"""

from __future__ import annotations

import json
import os
import sys
import time
from difflib import get_close_matches

import torch

from multigpu import records
from multigpu.experiments.checkpoints import checkpoint_bytes, checkpoint_cost
from multigpu.experiments.collectives import async_staleness, collectives_bandwidth, link_model
from multigpu.experiments.compositions import compositions, parity_matrix
from multigpu.experiments.context_parallel import cp_balance, cp_longest, cp_memory, cp_timeline, cp_variants
from multigpu.experiments.data_parallel import ddp_buckets, ddp_learning, ddp_scaling, ddp_vs_scratch, dp_vs_ddp
from multigpu.experiments.experts import moe_balance, moe_capacity, moe_ep
from multigpu.experiments.limits import machine_limits
from multigpu.experiments.machine import Job, on_gpus
from multigpu.experiments.model_parallel import (
    pp_bubble,
    pp_memory,
    pp_schedules,
    tp_collectives,
    tp_scaling,
    tp_width,
)
from multigpu.experiments.one_device import (
    machine_peak,
    one_device_memory,
    one_device_techniques,
    t5_largest_batch,
)
from multigpu.experiments.profiles import recomputation, step_profiles
from multigpu.experiments.sharding import fsdp_precision, largest_batch, offload, sharded_memory_comm
from multigpu.launch import launch

EXPERIMENTS = {
    "machine_limits": machine_limits,
    "one_device_memory": one_device_memory,
    "one_device_techniques": one_device_techniques,
    "machine_peak": machine_peak,
    "t5_largest_batch": t5_largest_batch,
    "ddp_scaling": ddp_scaling,
    "ddp_vs_scratch": ddp_vs_scratch,
    "ddp_buckets": ddp_buckets,
    "ddp_learning": ddp_learning,
    "dp_vs_ddp": dp_vs_ddp,
    "sharded_memory_comm": sharded_memory_comm,
    "largest_batch": largest_batch,
    "offload": offload,
    "fsdp_precision": fsdp_precision,
    "collectives_bandwidth": collectives_bandwidth,
    "async_staleness": async_staleness,
    "link_model": link_model,
    "tp_collectives": tp_collectives,
    "tp_width": tp_width,
    "tp_scaling": tp_scaling,
    "pp_bubble": pp_bubble,
    "pp_schedules": pp_schedules,
    "pp_memory": pp_memory,
    "compositions": compositions,
    "parity_matrix": parity_matrix,
    "cp_memory": cp_memory,
    "cp_variants": cp_variants,
    "cp_balance": cp_balance,
    "cp_longest": cp_longest,
    "cp_timeline": cp_timeline,
    "moe_balance": moe_balance,
    "moe_capacity": moe_capacity,
    "moe_ep": moe_ep,
    "checkpoint_bytes": checkpoint_bytes,
    "checkpoint_cost": checkpoint_cost,
    "step_profiles": step_profiles,
    "recomputation": recomputation,
}


def _identity(record: dict) -> str:
    """What a record is a measurement of: its job, or its run's config, every field the config
    has today (a record written before a field existed, e.g. cp, ran with its default)."""
    if "job" in record:
        return f"job {record['job']}"
    config = record.get("config")
    from multigpu.config import RunConfig

    return json.dumps({**RunConfig().to_dict(), **config} if isinstance(config, dict) else config, sort_keys=True)


class ExperimentFailed(RuntimeError):
    """Some runs of an experiment failed; the others' records (and the old ones) are kept."""


def run_experiment(name: str, *, progress: bool | None = None) -> list[dict]:
    """Run every item of experiment `name`; return the new records.

    Records are never lost: after every item the file is rewritten (whole, aside, then
    renamed) with the records made so far, beside the records from before that no new one
    replaces, so an interrupt or a crash keeps both. When every item has run, the file holds
    exactly the new records. An item that fails is reported and skipped (its old records
    stay); the experiment then raises ExperimentFailed after the others have run."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from: {', '.join(EXPERIMENTS)}")
    done: list[dict] = []
    failed: list[str] = []
    old: dict[str, list[dict]] = {}
    path = None
    items = EXPERIMENTS[name]()
    for i, item in enumerate(items, start=1):
        start = time.monotonic()
        what = item.name if isinstance(item, Job) else f"{item.strategy} x{item.world_size} {item.model}"
        try:
            if isinstance(item, Job):
                new = item.run(**item.kwargs)
                for record in new:
                    record["job"] = item.name
            else:
                new = [launch(item, progress=progress)]
                what += f": {new[0]['step_time_s'] * 1e3:.1f} ms/step"
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # noqa: BLE001 - reported, and the other items still run
            failed.append(f"{what}: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
            print(f"  [{name} {i}/{len(items)}] FAILED {failed[-1]}", flush=True)
            continue
        for record in new:
            record["experiment"] = name
        done += new
        tags = {r["provenance"]["machine_tag"] for r in done}
        if len(tags) > 1:
            raise RuntimeError(f"experiment {name} mixed devices ({', '.join(sorted(tags))}); "
                               "give its configs one device")
        if path is None:  # the records from before, by what they measure
            path = records.results_path(name, tags.pop())
            for record in records.read_records(path) if path.exists() else []:
                old.setdefault(_identity(record), []).append(record)
        replaced = {_identity(r) for r in done}
        kept = [] if i == len(items) and not failed else [
            r for key, rs in old.items() if key not in replaced for r in rs]
        records.write_records(path, kept + done)  # after every run: an interrupt keeps everything
        print(f"  [{name} {i}/{len(items)}] {what} ({time.monotonic() - start:.0f} s)", flush=True)
    if failed:
        if path is not None:  # the last item failed: the file still has the old records of every failure
            replaced = {_identity(r) for r in done}
            records.write_records(path, [r for key, rs in old.items() if key not in replaced for r in rs] + done)
        raise ExperimentFailed(f"{name}: {len(failed)} of {len(items)} run(s) failed: " + "; ".join(failed))
    return done


def check_results_dir(path) -> None:
    """Before the first run: the results folder (MULTIGPU_RESULTS, default results/) must be a
    folder this process can write, or become one; else say so, not after an hour of runs."""
    from pathlib import Path

    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"the results folder {path} cannot be made: {existing} is a file; point MULTIGPU_RESULTS "
                         "at a folder (or unset it for results/)")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"the results folder {path} cannot be written ({existing} is not writable); point "
                         "MULTIGPU_RESULTS at a folder you can write")


def run_experiments(names: list[str] | None = None) -> None:
    names = names or list(EXPERIMENTS)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        close = [f"{name!r} (did you mean {' or '.join(found)}?)" if (found := get_close_matches(name, EXPERIMENTS, 2))
                 else repr(name) for name in unknown]
        raise ValueError(f"unknown experiment(s) {', '.join(close)}; `python -m multigpu figures --list` names "
                         f"all {len(EXPERIMENTS)}")
    check_results_dir(records.RESULTS_DIR)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if on_gpus() else []
    print(f"multigpu figures: {len(names)} experiment(s) on {records.machine_tag()}: {records.cpu_name()}, "
          f"{os.cpu_count()} cores, {len(gpus)} CUDA GPU(s){' (' + ', '.join(gpus) + ')' if gpus else ''}; "
          f"torch {torch.__version__}; writing to {records.RESULTS_DIR}/<machine>/ (from {records.RESULTS_FROM})",
          flush=True)
    start = time.monotonic()
    failures = []
    for name in names:
        try:
            run_experiment(name, progress=False)
        except KeyboardInterrupt:
            print(f"multigpu figures: interrupted during {name}; the runs that finished are kept in "
                  f"{records.RESULTS_DIR}/<machine>/{name}.jsonl, beside the records from before",
                  file=sys.stderr, flush=True)
            raise
        except ExperimentFailed as err:
            failures.append(str(err))
    print(f"multigpu figures: done in {time.monotonic() - start:.0f} s; {len(names) - len(failures)} of "
          f"{len(names)} experiment(s) recorded whole", file=sys.stderr, flush=True)
    if failures:
        raise ExperimentFailed("some runs failed (their old records are kept):\n" + "\n".join(failures))
