"""Result records: one JSON object per run, one JSON-lines file per experiment.

    results/<machine-tag>/<experiment>.jsonl

A record holds the run's `config`, its measurements and `provenance` (commit, date,
versions, devices), so every figure can say which machine, backend and date produced it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import warnings
from pathlib import Path

import torch


def find_checkout(start: Path) -> Path | None:
    """The book's checkout that holds `start` (the folder whose pyproject.toml names this
    package), or None."""
    for folder in (start, *start.parents):
        pyproject = folder / "pyproject.toml"
        try:
            if pyproject.is_file() and 'name = "multigpu"' in pyproject.read_text(errors="replace"):
                return folder
        except OSError:
            continue
    return None


def _results_dir() -> tuple[Path, str]:
    """Where records are written and read, and why there: MULTIGPU_RESULTS, else the results/
    of the checkout the package runs from (an editable install, `make`), else of the checkout
    the current folder is in (a chapter executed from book/ with the package pip-installed),
    else ./results."""
    if os.environ.get("MULTIGPU_RESULTS"):
        return Path(os.environ["MULTIGPU_RESULTS"]).expanduser(), "MULTIGPU_RESULTS"
    if CHECKOUT is not None:
        return CHECKOUT / "results", f"the checkout at {CHECKOUT}"
    return Path.cwd() / "results", ("the current folder: no checkout of the book here or above it; "
                                     "MULTIGPU_RESULTS sets another")


CHECKOUT = find_checkout(Path(__file__).resolve().parent) or find_checkout(Path.cwd())
RESULTS_DIR, RESULTS_FROM = _results_dir()


class CorruptRecordWarning(UserWarning):
    """A line of a results file that is not a JSON record; the others were kept."""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """The commit the code ran from, '-dirty' if code (not recorded results) was changed."""
    def git(*args):
        return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    if CHECKOUT is None:
        return None
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if changed else "")) if commit else None


def provenance(backend: str, world_size: int, device_type: str, threads_per_worker: int) -> dict:
    import transformers

    cuda = device_type == "cuda"
    return {
        "git_commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "backend": backend,
        "world_size": world_size,
        "device_type": device_type,
        "device_names": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda
                         else [cpu_name()]),
        "cpu_count": os.cpu_count(),
        "threads_per_worker": threads_per_worker,
        "machine_tag": machine_tag(device_type),
        **(_cuda_facts() if cuda else {}),
    }


def _cuda_facts() -> dict:
    """What the memory estimate needs to know of this process's GPU, from torch itself
    (multigpu.estimator.question.cublas_workspace_bytes): one cuBLAS workspace's size as this torch
    chooses it (by architecture, or CUBLAS_WORKSPACE_CONFIG), and the compute capability.
    A torch without `cublas_workspace_size` (before 2.13) leaves the size out: the estimate
    then goes by the capability."""
    size = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    return {"compute_capability": list(torch.cuda.get_device_capability()),
            **({"cublas_workspace_size_bytes": size()} if size else {})}


def executed_here() -> str:
    """One line for the foot of a chapter: when, on what and with which versions it was
    executed (the figures above it say where their records come from)."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    devices = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if cuda
               else f"{cpu_name()}, {os.cpu_count()} cores, no GPU")
    commit = _git_commit()
    return (f"Executed {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {machine_tag()} ({devices}) "
            f"with torch {torch.__version__} and Python {platform.python_version()}"
            + (f", from commit {commit}." if commit else "."))


def machine_tag(device_type: str = "auto") -> str:
    """'cpu-2core-gloo' or e.g. '8xH100-nccl': the folder records go to. It names what ran
    them: CPU runs on a GPU machine are filed under the CPU tag."""
    if device_type != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        name = torch.cuda.get_device_name(0).replace("NVIDIA", "").strip()
        short = next((w for w in name.split() if any(c.isdigit() for c in w)), name.split()[0])
        return f"{torch.cuda.device_count()}x{short}-nccl"
    return f"cpu-{os.cpu_count()}core-gloo"


# -- reading and writing ---------------------------------------------------------------

def results_path(experiment: str, tag: str | None = None) -> Path:
    return RESULTS_DIR / (tag or machine_tag()) / f"{experiment}.jsonl"


def write_records(path: Path, records: list[dict]) -> None:
    """Replace `path` with `records`, all or nothing (write aside, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the old file, if any, is untouched
        raise


def read_records(path: Path) -> list[dict]:
    """Every valid record of a JSON-lines file. A corrupt line is reported (file and line
    number) with a warning and skipped; the other records are kept."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
            except ValueError as err:
                warnings.warn(f"{path}: line {number} is not a valid record ({err}); "
                              "skipped it and kept the other lines", CorruptRecordWarning, stacklevel=2)
                continue
            records.append(record)
    return records


def machines_with(experiment: str) -> list[str]:
    """Machine tags that have records of `experiment`, richest first (GPUs, then cores)."""
    tags = [p.parent.name for p in RESULTS_DIR.glob(f"*/{experiment}.jsonl")]

    def richness(tag: str):  # '8xH100-nccl' -> (1, 8), 'cpu-2core-gloo' -> (0, 2)
        if tag.startswith("cpu-"):
            return (0, int(re.sub(r"\D", "", tag.split("-")[1]) or 0), tag)
        count = tag.split("x")[0]
        return (1, int(count) if count.isdigit() else 0, tag)

    return sorted(tags, key=richness, reverse=True)


def load(experiment: str, tag: str | None = None, needs=None) -> list[dict]:
    """Records of `experiment` from machine `tag`, or from the richest machine that has them;
    with `needs`, a test of a machine's records (e.g. that they hold the runs a figure compares),
    the richest machine whose records pass it: a `make figures` that was stopped, or whose
    runs failed, leaves a machine's file without them, and its figure is then drawn from the
    next machine's."""
    if tag is None:
        tags = machines_with(experiment)
        if not tags:
            raise FileNotFoundError(
                f"no records of experiment {experiment!r} under {RESULTS_DIR}; "
                f"run `python -m multigpu figures --experiments {experiment}` to make them"
            )
        for tag in tags if needs is not None else tags[:1]:
            runs = read_records(results_path(experiment, tag))
            if needs is None or needs(runs):
                return runs
        raise FileNotFoundError(
            f"no machine's records of experiment {experiment!r} under {RESULTS_DIR} hold the runs this "
            f"figure needs ({', '.join(tags)} were read); run `python -m multigpu figures --experiments "
            f"{experiment}` to make them")
    return read_records(results_path(experiment, tag))


def caption(records: list[dict]) -> str:
    """'Measured on 8xH100-nccl (nccl, NVIDIA H100 80GB HBM3, torch 2.13.0+cu128), 2026-11-21,
    commit 1a2b3c4d5e6f.' Every backend the runs used (threads: DataParallel's replicas); a
    run of one process has none."""
    if not records:
        return "No records."
    p = records[0]["provenance"]
    dates = sorted(r["provenance"]["date"][:10] for r in records)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    backends = ", ".join(sorted({r["provenance"]["backend"] for r in records} - {"none"})) or "one process"
    device = ", ".join(sorted(set(p["device_names"])))
    return (f"Measured on {p['machine_tag']} ({backends}, {device}, torch {p['torch']}), "
            f"{when}, commit {p['git_commit'] or 'unknown'}.")
