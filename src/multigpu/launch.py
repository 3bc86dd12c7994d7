"""Start N worker processes under torchrun and bring back their record.

Usable from a notebook cell, the command line and tests alike:

    record = launch(RunConfig(strategy="ddp", world_size=2))

Notebook functions cannot be sent to spawned processes, so the workers run the
`multigpu.worker` module; a run is described by its RunConfig, written to a file.
Whatever happens, `launch` returns a record or raises a `LaunchError` that says what went
wrong: a worker's traceback tail, a killed worker, a timeout. It never hangs.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from multigpu.config import ConfigError, RunConfig
from multigpu.estimator import fits
from multigpu.progress import PROGRESS_MARK, progress_view
from multigpu.watchdog import start_watchdog

_SRC = str(Path(__file__).resolve().parents[1])
_announced: set[str] = set()


class LaunchError(RuntimeError):
    """The run could not produce a record; the message says why and what to do. (A series:
    `records` holds those of the runs that finished before the one that failed.)"""

    records: list = []


def _say_once(message: str) -> None:
    if message not in _announced:
        _announced.add(message)
        print(message, file=sys.stderr, flush=True)


def threads_per_process(processes: int) -> int:
    """The machine's cores split evenly over the processes (at least one each)."""
    return max(1, (os.cpu_count() or 1) // processes)


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise LaunchError(
                f"port {port} is already in use on this machine, so the workers cannot meet "
                "there; pass another port, or none to let torchrun pick a free one"
            ) from None


def _show_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    if os.environ.get("MULTIGPU_PROGRESS") is not None:
        return os.environ["MULTIGPU_PROGRESS"] not in ("0", "", "false")
    return sys.stderr.isatty() or "ipykernel" in sys.modules


# a traceback that only says "my peer went away" is a consequence, not the cause
_SECONDARY = ("Connection reset", "Connection closed", "DistBackendError", "Broken pipe", "SIGTERM")


def _failure_message(out_dir: Path, rc: int, output_tail: list[str]) -> str:
    """The root cause first: killed ranks, then ranks that raised, then ranks whose error
    only reports a peer that went away. (torchrun stops the survivors with SIGTERM, so a
    SIGTERM is named only when nothing else explains the failure.)"""
    text = "\n".join(output_tail)
    killed, stopped = [], []
    for rank, code in re.findall(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", text):
        code = int(code)
        if code < 0 and -code in signal.Signals._value2member_map_:
            name = signal.Signals(-code).name
            hint = " (often: out of memory)" if name == "SIGKILL" else ""
            (stopped if name == "SIGTERM" else killed).append(f"rank {rank} was killed by signal {name}{hint}.")
    tracebacks = []
    for path in out_dir.glob("error-rank*.txt"):
        rank = int(path.stem.removeprefix("error-rank"))
        summary, *tb = path.read_text().strip().splitlines() or ["(no message)"]
        secondary = any(marker in summary for marker in _SECONDARY)
        tracebacks.append((secondary, rank, summary, tb))
    lines = [f"the run failed (torchrun exit code {rc}).", *killed]
    for secondary, rank, summary, tb in sorted(tracebacks):
        because = " (a consequence: a peer stopped)" if secondary else ""
        lines.append(f"rank {rank} raised {summary}{because}; traceback tail:")
        lines += ["    " + line for line in tb[-12:]]
    if not killed and not tracebacks:
        lines += stopped
        lines.append("no rank left a traceback; last lines of output:")
        lines += ["    " + line for line in output_tail[-15:]]
    return "\n".join(lines)


def launch(
    cfg: RunConfig,
    *,
    timeout_s: float = 900,
    progress: bool | None = None,
    port: int | None = None,
    params_path: Path | None = None,
    verbose: bool = False,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    check_memory: bool = True,
    max_restarts: int = 0,
) -> dict:
    """Run `cfg` on `cfg.world_size` processes; return the run's record (see records.py).

    timeout_s: stop every worker and raise if no record came back by then.
    port: rendezvous port on 127.0.0.1; None lets torchrun pick a free one.
    params_path: also save the trained weights (rank 0's full copy) there.
    verbose: echo the workers' own output.
    Many nodes: every node calls `launch` with the same `cfg` (world_size counts the
    processes of all nodes), the same `nnodes` and `rdzv_endpoint` ("HOST:PORT", reachable
    from every node), and its own `node_rank`; node 0 hosts the rendezvous there. Each node
    starts world_size / nnodes workers; which global ranks they get is the rendezvous's
    choice. Every node gets the record back. An endpoint on a loopback address (127.0.0.1,
    localhost) means every node runs on this machine, as stand-ins sharing its GPUs (each node
    takes GPUs of its own, or all run on the CPU): on a real cluster give every node, node 0
    included, node 0's routable address.
    check_memory: refuse, before any worker starts, a run the estimator says cannot fit in
    this machine's free memory (`memory_problem`).
    max_restarts: torchrun's --max-restarts: after a worker fails, all are started again (this many times at
    most); with cfg.checkpoint_dir they continue from its newest checkpoint."""
    from multigpu.runtime import LOOPBACK_HOSTS, device_plan

    cfg.validate()
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535):
        raise ConfigError(f"port must be a whole number from 1 to 65535, got {port!r}; or give none to let "
                          "torchrun pick a free one")
    if not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout_s!r}")
    per_node = check_nodes(cfg, nnodes, node_rank, rdzv_endpoint, port)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or not 0 <= max_restarts <= 100:
        raise ConfigError(f"max_restarts must be a whole number from 0 to 100, got {max_restarts!r}")
    # nodes meeting on a loopback address are stand-ins on this one machine: they share its GPUs
    on_loopback = rdzv_endpoint is not None and str(rdzv_endpoint).rpartition(":")[0] in LOOPBACK_HOSTS
    try:
        plan = device_plan(cfg, nnodes=nnodes, node_rank=node_rank, nodes_here=nnodes if on_loopback else 1)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    device, why = plan.device, plan.why
    if check_memory:  # (stand-in nodes on the CPU share its memory; on GPUs, each node its first GPU's)
        problem = fits.memory_problem(cfg, device, per_node * (nnodes if on_loopback else 1), gpu=plan.first_gpu)
        if problem:
            raise ConfigError(problem)
    if cfg.info.one_process:  # one process: no backend, the replicas are threads
        import importlib

        why = importlib.import_module(f"multigpu.strategies.{cfg.info.module}").launch_note(cfg, device)
    from multigpu.checkpoint_guard import before_launch

    before_launch(cfg, node_rank)  # the checkpoint resumed is whole (and converted); the folder saved into writable
    _say_once(f"multigpu: using {why}")

    if rdzv_endpoint is not None:
        # node 0 hosts the rendezvous store; the others only connect to it. Joining waits at
        # most timeout_s for every node, and each store read at most a minute
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=multigpu",
                      f"--rdzv-conf=is_host={int(node_rank == 0)},join_timeout={math.ceil(timeout_s)},"
                      f"read_timeout={min(60, math.ceil(timeout_s))}"]
    elif port is not None:
        check_port_free(port)
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    else:
        rendezvous = ["--standalone"]
    out_dir = Path(tempfile.mkdtemp(prefix="multigpu-run-"))
    try:  # whatever happens, the run's folder goes away
        return _run(cfg, device, rendezvous, out_dir, timeout_s=timeout_s, progress=progress,
                    params_path=params_path, verbose=verbose, nnodes=nnodes, endpoint=rdzv_endpoint,
                    visible_gpus=plan.visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")),
                    max_restarts=max_restarts)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def launch_series(cfgs: list[RunConfig], *, timeout_s: float = 900, params_dir: Path | None = None) -> list[dict]:
    """Run several configs one after another in the same worker processes: one torchrun and one
    process group for all, each run training its own model from its own seed, into its own
    record. The parity tests run dozens of small runs; starting torchrun and importing torch
    again for each cost more than the runs. One machine; every config starts the same number of
    processes on the same device. params_dir: also save each run's trained weights there, as
    run<i>.pt. A failing run raises LaunchError, whose `records` are the runs before it."""
    from multigpu.runtime import device_plan

    if not cfgs:
        return []
    from multigpu.checkpoint_guard import before_launch

    for cfg in cfgs:
        cfg.validate()
        before_launch(cfg)
    plans = {(cfg.processes, device_plan(cfg).device) for cfg in cfgs}
    if len(plans) > 1:
        raise ConfigError(f"a series runs in one set of processes: its configs start {sorted(plans)} "
                          "(processes, device); launch them in separate series")
    (processes, device), = plans
    out_dir = Path(tempfile.mkdtemp(prefix="multigpu-series-"))
    try:
        (out_dir / "config.json").write_text(json.dumps([cfg.to_dict() for cfg in cfgs]))
        args = ["-m", "multigpu.worker", "--config", str(out_dir / "config.json"), "--out", str(out_dir),
                "--device", device, *(["--save-params"] if params_dir is not None else [])]
        threads = cfgs[0].threads_per_worker or threads_per_process(processes)
        rc, tail = run_torchrun(args, processes=processes, rendezvous=["--standalone"], threads=threads,
                                timeout_s=timeout_s, progress=False, bar=(0, "series"), run_dir=out_dir,
                                timeout_hint=f"raise timeout_s or run fewer configs ({len(cfgs)}) in one series")
        done = []
        for i in range(len(cfgs)):  # the runs that finished, in order, with their weights
            run = out_dir / f"run{i}"
            if not (run / "record.json").exists():
                break
            done.append(json.loads((run / "record.json").read_text()))
            if params_dir is not None:
                shutil.move(run / "params.pt", Path(params_dir) / f"run{i}.pt")
        if rc != 0 or len(done) < len(cfgs):
            failed = cfgs[len(done)]
            error = LaunchError(f"run {len(done) + 1} of {len(cfgs)} in the series ({failed.strategy} on "
                                f"{failed.world_size}) failed: " + _failure_message(out_dir, rc, tail))
            error.records = done
            raise error
        return done
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def check_nodes(cfg: RunConfig, nnodes, node_rank, rdzv_endpoint, port) -> int:
    """The node arguments, checked before anything starts; returns the processes per node."""
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ConfigError(f"nnodes must be a whole number >= 1, got {nnodes!r}")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ConfigError(f"node_rank must be a whole number from 0 to nnodes - 1 = {nnodes - 1}, got {node_rank!r}")
    if nnodes > 1 and rdzv_endpoint is None:
        raise ConfigError(f"{nnodes} nodes need a rendezvous endpoint every node can reach: pass "
                          "rdzv_endpoint='HOST:PORT' (--rdzv-endpoint), HOST being node 0's address")
    if rdzv_endpoint is not None:
        if port is not None:
            raise ConfigError("give either port (one machine) or rdzv_endpoint (HOST:PORT, many nodes), not both")
        host, _, number = str(rdzv_endpoint).rpartition(":")
        if not host or not number.isdigit() or not 1 <= int(number) <= 65535:
            raise ConfigError(f"rdzv_endpoint must look like HOST:PORT with a port from 1 to 65535 "
                              f"(e.g. 10.0.0.1:29500), got {rdzv_endpoint!r}")
    if cfg.processes % nnodes:
        raise ConfigError(f"world_size={cfg.processes} processes do not split evenly over {nnodes} nodes; use a "
                          f"multiple of {nnodes} (each node runs world_size / nnodes)")
    return cfg.processes // nnodes


def _run(cfg: RunConfig, device: str, rendezvous: list[str], out_dir: Path, *, timeout_s, progress,
         params_path, verbose, nnodes: int = 1, endpoint: str | None = None,
         visible_gpus: str | None = None, max_restarts: int = 0) -> dict:
    (out_dir / "config.json").write_text(cfg.to_json())
    args = ["-m", "multigpu.worker", "--config", str(out_dir / "config.json"), "--out", str(out_dir),
            "--device", device, *(["--save-params"] if params_path is not None else [])]
    from multigpu.checkpoint_guard import checkpoint_refusal

    start = time.monotonic()
    per_node = cfg.processes // nnodes
    try:
        rc, tail = run_torchrun(
            args, processes=per_node, rendezvous=rendezvous, nnodes=nnodes,
            threads=cfg.threads_per_worker or threads_per_process(per_node),
            timeout_s=timeout_s, progress=progress, bar=(cfg.steps, f"{cfg.strategy} x{cfg.world_size}"),
            verbose=verbose, visible_gpus=visible_gpus, max_restarts=max_restarts, run_dir=out_dir,
            timeout_hint=f"raise timeout_s or run fewer steps ({cfg.steps}) or a smaller model ({cfg.model})")
    except LaunchError:
        if endpoint is not None and not any(out_dir.glob("started-rank*")):  # no worker ever started
            raise LaunchError(_rendezvous_message([f"this node's workers never started within {timeout_s:g} s, "
                                                   "so it was stopped"], endpoint, nnodes)) from None
        raise
    if rc != 0 and endpoint is not None and not any(out_dir.glob("started-rank*")):
        raise LaunchError(_rendezvous_message(tail, endpoint, nnodes))
    if rc != 0 and (found := checkpoint_refusal(out_dir)):  # a checkpoint a worker found damaged: one line
        raise found
    if rc != 0 or not (out_dir / "record.json").exists():
        raise LaunchError(_failure_message(out_dir, rc, tail))
    record = json.loads((out_dir / "record.json").read_text())
    record["wall_time_s"] = time.monotonic() - start
    if params_path is not None:
        shutil.move(out_dir / "params.pt", params_path)
    return record


def _rendezvous_message(tail: list[str], endpoint: str, nnodes: int) -> str:
    """torchrun never started this node's workers: the nodes did not meet. Say where, and why
    that usually happens."""
    error = next((line.strip() for line in reversed(tail) if "Rendezvous" in line and "Error" in line), tail[-1])
    return (f"the nodes did not meet at {endpoint}: {error}\n"
            f"Check that node 0 runs the same command with node_rank 0 (it hosts the rendezvous), that all "
            f"{nnodes} nodes were started, that every node reaches {endpoint} (address and firewall), and "
            "that the port is free on node 0.")


def run_torchrun(args: list[str], *, processes: int, rendezvous: list[str], threads: int, timeout_s: float,
                 progress: bool | None, bar: tuple[int, str], verbose: bool = False,
                 timeout_hint: str = "raise timeout_s", nnodes: int = 1,
                 visible_gpus: str | None = None, max_restarts: int = 0,
                 run_dir: Path | None = None) -> tuple[int, list[str]]:
    """Run `python -m torch.distributed.run ... <args>` on `processes` workers of this node
    (one of `nnodes`); return (exit code, last output lines). Draws progress lines as a bar;
    stops every worker on a timeout or an interrupt, so nothing is left running, and, through a
    watchdog process (multigpu.watchdog), also when this process is killed: then the watchdog stops
    them and removes `run_dir`, the run's folder.
    visible_gpus: the workers' CUDA_VISIBLE_DEVICES (the device plan's, for a stand-in node)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nnodes={nnodes}",
           f"--nproc-per-node={processes}", f"--max-restarts={max_restarts}", *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([_SRC, *filter(None, [os.environ.get("PYTHONPATH")])]))
    if visible_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus

    view = progress_view(bar) if _show_progress(progress) else None
    tail: deque[str] = deque(maxlen=200)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    watchdog = start_watchdog(proc.pid, run_dir)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                              daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        while True:
            remaining = timeout_s - (time.monotonic() - start)
            if remaining <= 0:
                _stop(proc)
                raise LaunchError(f"no result after {timeout_s:g} s, so every worker was stopped; {timeout_hint}")
            try:
                line = lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            line = line.rstrip("\n")
            if line.startswith(PROGRESS_MARK):
                if view is not None:
                    view.update(*line.split()[1:])
                continue
            tail.append(line)
            if verbose:
                print(line, flush=True)
        return proc.wait(), list(tail)
    except BaseException:  # timeout, Ctrl-C, or anything else: leave no worker behind
        _stop(proc)
        raise
    finally:
        watchdog.kill()  # torchrun has ended or been stopped: nothing left to watch
        watchdog.wait()
        if view is not None:
            view.close()


def _stop(proc: subprocess.Popen) -> None:
    """Terminate torchrun and all its workers (one process group), then make sure."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
