"""The torchrun entry point: one process of a run.

    python -m torch.distributed.run --nproc-per-node N -m multigpu.worker --config C --out DIR

Builds everything from the RunConfig in C, trains with the shared loop, gathers every
rank's measurements on rank 0, which writes DIR/record.json. A rank that fails writes its
traceback to DIR/error-rank<R>.txt so the launcher can show it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from multigpu import device_guard, runtime
from multigpu.config import RunConfig
from multigpu.memory import CATEGORIES


def build_record(cfg: RunConfig, rt, results: list[dict]) -> dict:
    """Rank 0: fold every rank's measurements into one record (schema: records.py)."""
    from multigpu.records import provenance

    steps = len(results[0]["loss"])
    # the global loss is the mean of the ranks' losses (each rank holds an equal share)
    loss = [sum(r["loss"][s] for r in results) / len(results) for s in range(steps)]
    if resumed := results[0]["checkpoint"]["resumed"]:  # the restored steps: the saved run's record, all its ranks
        loss[:len(resumed["losses"])] = resumed["losses"]
    # the slowest rank sets the pace (None: no step was trained, a checkpoint saved again under a new layout)
    step_time_s = max(r["step_time_s"] for r in results) if results[0]["step_time_s"] is not None else None
    tokens_per_step = cfg.global_batch_size * results[0]["seq_len"]
    report = results[0]["strategy_report"]
    # one process, many replicas (dp): the strategy itself says what each replica holds
    peak_by_rank = report.pop("peak_memory_bytes_by_replica", None) or [
        {c: r["memory"][c] for c in (*CATEGORIES, "total")} for r in results]
    return {
        "config": cfg.to_dict(),
        # the rank grid the run made (grid.resolve_grid): `tp --world-size 4` has tp 4 here while its
        # config keeps the degrees as given (tp 1: not given); dp counts a one-process strategy's replicas
        "grid": cfg.grid.as_dict(),
        "parameters": results[0]["parameters"],
        "seq_len": results[0]["seq_len"],
        "step_time_s": step_time_s,
        "step_times_s_by_rank": [r["step_times_s"] for r in results],
        "timed_steps": results[0]["timed_steps"],
        "step_time_includes_tracking": results[0]["step_time_includes_tracking"],
        "tokens_per_s": tokens_per_step / step_time_s if step_time_s else None,
        "samples_per_s": cfg.global_batch_size / step_time_s if step_time_s else None,
        "loss": loss,
        "model_state_bytes_by_rank": [r["model_states"] for r in results],
        "peak_memory_bytes_by_rank": peak_by_rank,
        "saved_activation_bytes_by_rank": [m["activations"] for m in peak_by_rank] if cfg.info.one_process
        else [r["saved_activation_bytes"] for r in results],
        "cuda_allocator_peak_bytes_by_rank": [r["cuda_allocator_peak_bytes"] for r in results],
        # each rank's step peaks as the machine counts them (memory.ProcessPeaks), beside the tracker's
        "process_peak_by_rank": [r["process_peak"] for r in results],
        "comm_calls_per_step_by_rank": [r["comm_calls"] for r in results],
        "comm_payload_bytes_per_step_by_rank": [r["comm_payload_bytes"] for r in results],
        "comm_bytes_per_step_by_rank": [r["comm_sent_bytes"] for r in results],
        # measured: loopback bytes in one step, all ranks together (None if not measurable)
        "loopback_bytes_per_step": results[0]["loopback_bytes"],
        "strategy_report": report,
        # a mixture of experts: per layer and forward, tokens each expert was routed and tokens dropped (the whole
        # batch's: expert-parallel ranks add theirs up; one rank's otherwise)
        **({"moe": results[0]["moe"]} if results[0].get("moe") else {}),
        # checkpoints: what each save cost (time blocking the training, in all, bytes by rank), and where the run
        # resumed from (its record's losses then begin with the checkpoint's)
        **({"checkpoint": {"saves": [r["checkpoint"]["saves"] for r in results],
                           "resumed": results[0]["checkpoint"]["resumed"]}}
           if results[0]["checkpoint"]["saves"] or results[0]["checkpoint"]["resumed"] else {}),
        # extra["profile"]: the last step's time by category on each rank, and where its trace went (multigpu.profiling)
        **({"profile_by_rank": [r["profile"] for r in results]} if results[0].get("profile") else {}),
        # times torchrun started the workers again after a failure (--max-restarts) before this record
        **({"restarts": runtime.restart_count()} if runtime.restart_count() else {}),
        # a strategy whose ranks each report something of their own (a pipeline stage's events)
        "strategy_report_by_rank": [r["strategy_report"] for r in results]
        if len(results) > 1 and any(r["strategy_report"] for r in results[1:]) else None,
        # one process whose replicas are threads (dp): no backend carries its traffic
        "provenance": provenance("threads" if cfg.info.one_process else rt.backend, cfg.world_size,
                                 rt.device.type, torch.get_num_threads()),
    }


def write_error(out: Path, rank: int, err: BaseException) -> None:
    """For the launcher: first line what went wrong, in one line; then the full traceback."""
    summary = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    (out / f"error-rank{rank}.txt").write_text(summary + "\n" + traceback.format_exc())


def run_worker(out: Path, body: Callable[[int], None]) -> NoReturn:
    """The frame of every torchrun worker: body(rank); on failure its traceback goes to
    out/error-rank<R>.txt for the launcher; the process group is torn down after success
    only (after a failure, os._exit releases it without waiting for the peers).

    The worker leaves with os._exit, skipping the interpreter's finalization.
    Gloo's worker threads can still be releasing a finished collective's tensors then
    (DeepSpeed keeps its process groups alive past destroy_process_group), and a thread
    that takes the GIL during finalization aborts the process, a run whose results were
    all written (pytorch/pytorch#190489). Everything a worker produces is on disk by then."""
    rank = int(os.environ.get("RANK", 0))
    (out / f"started-rank{rank}").touch()  # torchrun starts workers once the nodes have met
    code = 0
    try:
        body(rank)
    except BaseException as err:
        write_error(out, rank, err)
        traceback.print_exc()
        code = 1
    if code == 0:  # after a failure, peers may still be inside collectives: destroying the
        runtime.teardown()  # group can then hang under NCCL (torchtitan #1342); os._exit frees all
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def write_atomic(path: Path, data: bytes) -> None:
    """Write aside, then rename: the launcher never reads half a file. The aside name is
    this process's own: the first worker of every node writes the record, and nodes
    started by another launcher may share one --out folder."""
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv=None) -> NoReturn:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, type=Path,
                        help="a RunConfig as JSON; or a list of them: a series, run one after another by the "
                             "same processes, each into its own folder OUT/run<i> (launch.launch_series)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--save-params", action="store_true", help="rank 0 writes params.pt")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)  # a launcher other than ours may not have made it

    def body(rank: int) -> None:
        given = json.loads(args.config.read_text())
        guarded = device_guard.install_if_asked()  # the test suite checks the device rule in every run
        rt = runtime.init(args.device)
        if rt.backend == "nccl" and any(c.get("checkpoint_dir") or c.get("resume")
                                        for c in (given if isinstance(given, list) else [given])):
            runtime.check_host_group()  # an unroutable gloo interface fails now, not at the first save
        run_configs(given, rt, args.out, save_params=args.save_params, guarded=guarded)

    run_worker(args.out, body)


def run_configs(given: dict | list, rt, out_dir: Path, save_params: bool = False, guarded: bool = False) -> list:
    """Train one config (a RunConfig as a dict) into out_dir, or each of a list (a series) into out_dir/run<i>;
    the first rank of each node writes the record. Each run of a series ends as a fresh process would: the
    process groups it made destroyed (their number, per run, is returned), ZeRO-3's patch undone."""
    from multigpu.train import train

    destroyed = []
    for i, data in enumerate(given if isinstance(given, list) else [given]):
        out = out_dir / f"run{i}" if isinstance(given, list) else out_dir
        out.mkdir(exist_ok=True)
        before = runtime.process_groups()
        cfg = RunConfig.from_dict(data)
        result = train(cfg, rt, keep_params=save_params)
        state_dict = result.pop("state_dict")
        gathered = [None] * rt.world_size
        dist.all_gather_object(gathered, result)
        if rt.local_rank == 0:  # every node's launcher gets the record (all ranks have every result)
            if save_params:
                torch.save(state_dict, out / "params.pt")
            record = build_record(cfg, rt, gathered)
            record["device_rule_checked"] = guarded  # every collective's tensor was on the rank's device
            write_atomic(out / "record.json", json.dumps(record).encode())
        del result, state_dict, gathered
        if isinstance(given, list):  # the next run of the series starts as a fresh process would
            from multigpu.strategies.deepspeed import restore_torch_linear

            restore_torch_linear()
            dist.barrier()  # every rank is past the run's last collective on its groups
            destroyed.append(runtime.destroy_groups_since(before, rt.device))
        dist.barrier()
    return destroyed


if __name__ == "__main__":
    main()
