"""Run one function on N processes and bring back what each returned.

    results = run_spmd("multigpu.collectives:demo", world_size=4)   # a list, one per rank

"SPMD": single program, multiple data. Every process runs the same function, told its
rank by `torch.distributed`. The function must be importable ("module:name"; a notebook's
own functions cannot be sent to other processes); its keyword arguments and return value
must pickle. The launcher is the one training runs use (multigpu.launch): same timeout,
same cleanup, the failing rank's traceback in the error.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from multigpu import runtime
from multigpu.config import ConfigError, max_cpu_workers


def run_spmd(target: str, world_size: int, *, timeout_s: float = 600, threads: int | None = None,
             progress: bool | None = False, verbose: bool = False, **kwargs) -> list:
    """Call `target(**kwargs)` on `world_size` CPU processes (gloo); return their results."""
    from multigpu.launch import LaunchError, _failure_message, run_torchrun, threads_per_process

    if not isinstance(world_size, int) or not 1 <= world_size <= max_cpu_workers():
        raise ConfigError(f"world_size must be a whole number from 1 to {max_cpu_workers()}, got {world_size!r}")
    module, _, name = target.partition(":")
    try:
        found = bool(module) and callable(getattr(importlib.import_module(module), name, None))
    except ImportError:
        found = False
    if not name or not found:
        raise ConfigError(f"target must name an importable function as 'module:function', got {target!r}")
    try:
        arguments = pickle.dumps(kwargs)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise ConfigError(f"the keyword arguments must pickle to reach the other processes: {err}") from None
    out_dir = Path(tempfile.mkdtemp(prefix="multigpu-spmd-"))
    try:
        (out_dir / "kwargs.pkl").write_bytes(arguments)
        rc, tail = run_torchrun(
            ["-m", "multigpu.spmd", target, "--out", str(out_dir)], processes=world_size,
            rendezvous=["--standalone"], threads=threads or threads_per_process(world_size),
            timeout_s=timeout_s, progress=progress, bar=(0, f"{name} x{world_size}"), verbose=verbose)
        paths = [out_dir / f"result-rank{r}.pkl" for r in range(world_size)]
        if rc != 0 or not all(p.exists() for p in paths):
            raise LaunchError(_failure_message(out_dir, rc, tail))
        return [pickle.loads(p.read_bytes()) for p in paths]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def main(argv=None) -> NoReturn:
    from multigpu.worker import run_worker, write_atomic

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)

    def body(rank: int) -> None:
        module, _, name = args.target.partition(":")
        fn = getattr(importlib.import_module(module), name)
        kwargs = pickle.loads((args.out / "kwargs.pkl").read_bytes())
        runtime.init("cpu")  # by design (no guard of the device rule: the CPU is every rank's device)
        write_atomic(args.out / f"result-rank{rank}.pkl", pickle.dumps(fn(**kwargs)))
        dist.barrier()

    run_worker(args.out, body)


if __name__ == "__main__":
    main()
