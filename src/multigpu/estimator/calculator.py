"""The memory calculator of the static site: the estimator's answers, precomputed.

A reader of the HTML has no kernel, so the page cannot call `estimate`. It does not need to:
for one setup (model, strategy, GPUs, precision, checkpointing) every phase of a step that
`peak._phases` weighs holds, per category, an amount that is a straight line in the
per-rank batch b, `const + slope * b` (parameters, gradients and optimizer state are
constant; saved activations and the loss's tensors grow with b). So the grid stores, for
every setup and every pipeline rank, each phase's lines, checked against the estimator at
other batches; the page (book/_static/calculator.js) evaluates them at the reader's batch
exactly as `estimate` picks its peak (the largest phase of the largest rank, each category
truncated to whole bytes) and searches the largest batch as `peak.predict_largest_batch` does.

The optimizer changes one category only (`model_states`), so it is stored apart, once per rank,
with what its step allocates beside the states (`peak.optimizer_step_temporary`): Adam's
temporaries make an "optimizer step" phase, which SGD's step, updating in place, does not have.

The grid is committed (book/_static/calculator-grid.js, `GRID_FILE`): it takes minutes to compute, and
a clean clone (CI's, a reader's) would compute it again for every build. Its first line names what it
was computed from: the package's source files its computation imported (each worker process lists
its own) and torch's and transformers' versions, with their hash. `make book` (book/_ext/calculator.py)
computes it again when that hash has changed; tests/test_book.py fails when the committed grid is
not current, and says to run `python -m multigpu.estimator.calculator` and commit the file;
tests/test_site.py asks the page for sampled setups and batches and compares with `estimate` and
`predict_largest_batch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

import multigpu
from multigpu.errors import ConfigError
from multigpu.estimator.model_trace import model_shape
from multigpu.estimator.peak import (
    STEP_PHASE,
    _cuda_overheads,
    _phases,
    estimate,
    model_states,
    optimizer_step_temporary,
)
from multigpu.estimator.question import DEFAULT_CUDA_CONTEXT, GPUS, PIPELINES, Setup, cublas_workspace_bytes
from multigpu.estimator.share import rank_shares
from multigpu.memory import CATEGORIES
from multigpu.models import max_seq_len
from multigpu.recompute import recompute_mode
from multigpu.strategy_table import ESTIMATED

SEQ_LEN = 256  # tokens per sample of every setting
# and longer samples, the question of context parallelism (what a longer sample costs each GPU, and what
# cutting it over cp-scratch's ranks saves): for the GPT models whose position table holds them, with
# these strategies alone (each length adds about a tenth to the grid and to its minutes of building)
LONG_SEQ_LENS = (1024, 2048)
LONG_STRATEGIES = ("single", "fsdp", "cp-scratch")
# GPT-3's widths and depths (Brown et al. 2020, table 2.1; for 13b, 40 heads of 128 = 5120 where the table
# prints 5140) beside the presets, as config files. The heads are the book's choice, not the table's:
# gpt-1.3b has 32 here, the table's XL 24 (the choosing chapter's map uses the same shapes and says so)
GPT3_SHAPES = {"gpt-1.3b": (2048, 24, 32), "gpt-6.7b": (4096, 32, 32), "gpt-13b": (5120, 40, 40)}
PRESET_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "t5-large", "t5-3b", "gpt-moe-small")
# every strategy the estimator models as itself (the strategy table's ESTIMATED) but
# pp-interleaved, which the page has left out since it was made: its choices of schedule are
# GPipe and 1F1B, and each strategy adds a tenth to the grid and to its minute of building.
# ep-scratch is the mixture of experts' (gpt-moe-small's), its experts over every rank; cp-scratch
# cuts every sample over every rank (cp = the GPUs)
STRATEGIES = tuple(s for s in ESTIMATED if s != "pp-interleaved")
GPU_COUNTS = (1, 2, 4, 8, 16)
TP_DEGREES = (1, 2, 4, 8)  # with fsdp (2D) and the pipelines; strategy tp takes every GPU
DTYPES = ("fp32", "bf16-mixed", "bf16-master")
OPTIMIZERS = ("sgd", "sgd-momentum", "adamw")  # adam holds what adamw holds
MICROBATCHES_PER_STAGE = 2  # a pipeline runs 2 x its stages micro-batches per step
PROBES = (3, 7, 1000)  # batches at which each line is checked against the estimator


class NotLinear(AssertionError):
    """The estimator no longer grows linearly in the batch within a phase: the grid would lie."""


def gpt3_config(folder: Path, name: str, d_model: int, layers: int, heads: int) -> str:
    """A GPT-2 shaped model of GPT-3's size, as the Hugging Face config file the estimator reads."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50304, "n_layer": layers, "n_head": heads,
                                "n_embd": d_model, "n_positions": 2048}))
    return str(path)


def models(folder: Path) -> dict[str, str]:
    """label -> what the estimator is given (a preset's name or a config file's path)."""
    found = {name: name for name in PRESET_MODELS}
    found.update({name: gpt3_config(folder, name, *shape) for name, shape in GPT3_SHAPES.items()})
    return found


def setup_of(model: str, strategy: str, gpus: int, tp: int, dtype: str, checkpointing: bool | str,
             optimizer: str = "adamw", gpu: str | None = None, seq_len: int = SEQ_LEN) -> Setup:
    """The page's setting as the estimator's question, as a GPU runs it (its kernels: `on_cuda`).
    With `gpu` (a name of GPUS), also what `estimate --gpu` adds for that GPU: the CUDA context
    (assumed at the command line's default) and its cuBLAS workspaces. The grid's entries leave
    both out and store them per GPU (`gpu_overhead`): the page adds those of the GPU chosen."""
    pipeline = strategy in PIPELINES
    return Setup(model, strategy, gpus, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                 activation_checkpointing=checkpointing, tp=tp if strategy != "tp" else 1,
                 grad_accum_steps=MICROBATCHES_PER_STAGE * max(1, gpus // tp) if pipeline else 1,
                 on_cuda=True, cuda_context_bytes=DEFAULT_CUDA_CONTEXT if gpu else 0,
                 cuda_workspace_bytes=cublas_workspace_bytes(gpu) if gpu else 0)


def gpu_overhead(gpu: str | None) -> int:
    """What the page adds to "other" for a GPU (None: one it does not name, with the smaller
    workspaces of the GPUs before Hopper): the context and cuBLAS's workspaces."""
    return DEFAULT_CUDA_CONTEXT + cublas_workspace_bytes(gpu or "unnamed")


def _lines(setup: Setup, share, states: dict) -> list[tuple[str, list[float]]]:
    """[(phase, [const, slope] per category but the optimizer's, flattened)] for one rank."""
    one, two = _phases(setup, share, states, 1), _phases(setup, share, states, 2)
    kept = [c for c in CATEGORIES if c != "optimizer"]
    found = []
    for phase in one:
        pairs = []
        for category in kept:
            slope = two[phase][category] - one[phase][category]
            pairs += [one[phase][category] - slope, slope]
        found.append((phase, pairs))
    for b in PROBES:  # each phase, each category, a line: checked far from where it was drawn
        at = _phases(setup, share, states, b)
        for phase, pairs in found:
            for i, category in enumerate(kept):
                line, true = pairs[2 * i] + pairs[2 * i + 1] * b, at[phase][category]
                if abs(line - true) > 1 + 1e-9 * abs(true):
                    raise NotLinear(f"{setup}: {phase}/{category} at batch {b} is {true}, the line says {line}")
    return found


def entry(setup: Setup, label: str) -> dict:
    """One setup's lines, or the estimator's refusal (naming the model by its label)."""
    try:
        estimate(setup)  # the estimator's own checks: a setup it refuses, the page refuses with its words
        shares = rank_shares(setup)
    except ConfigError as refused:
        return {"error": str(refused).replace(setup.model, label)}
    d = setup.grid.as_dict()
    ranks, optimizer, step = [], {name: [] for name in OPTIMIZERS}, {name: [] for name in OPTIMIZERS}
    for share in shares:
        states = model_states(setup, share)
        phases = _lines(setup, share, states)
        ranks.append({"rank": share.pipeline_rank, "phases": phases})
        names = [phase for phase, _ in phases]
        for name in OPTIMIZERS:
            other = replace(setup, optimizer=name)
            other_states = model_states(other, share)
            if {k: v for k, v in other_states.items() if k != "optimizer"} != \
                    {k: v for k, v in states.items() if k != "optimizer"}:
                raise NotLinear(f"{setup}: optimizer {name} changes more than the optimizer's state")
            temporary = optimizer_step_temporary(other, share)
            other_names = list(_phases(other, share, other_states, 1))
            if other_names != [n for n in names if n != STEP_PHASE or temporary]:
                raise NotLinear(f"{setup}: optimizer {name} changes the phases beyond its step's: {other_names}")
            optimizer[name].append(other_states["optimizer"])
            step[name].append(temporary)
    return {"dp": d["dp"], "pp": d["pp"], "tp": d["tp"], "cp": d.get("cp", 1), "m": setup.grad_accum_steps,
            # the allocator's rounding, which counts the optimizer's copies of every parameter tensor
            "overhead": {name: _cuda_overheads(replace(setup, optimizer=name)) for name in OPTIMIZERS},
            "ranks": ranks, "optimizer": optimizer, "step": step}


RECOMPUTATION = ("none", "full", "selective")  # activation checkpointing's modes (multigpu.recompute)


def key(model: str, strategy: str, gpus: int, tp: int, dtype: str, checkpointing: bool | str,
        seq_len: int = SEQ_LEN) -> str:
    return f"{model}|{strategy}|{gpus}|{tp}|{dtype}|{recompute_mode(checkpointing) or 'none'}|{seq_len}"


GRID_FILE = Path(__file__).resolve().parents[3] / "book" / "_static" / "calculator-grid.js"  # in a checkout
STAMP = "// multigpu calculator grid, source "  # then the hash, " of ", and the source files it hashes


def _imported_sources() -> list[str]:
    """The package's source files this process has imported, relative to the package's folder."""
    root = Path(multigpu.__file__).resolve().parent
    return sorted(str(Path(module.__file__).resolve().relative_to(root)) for name, module in list(sys.modules.items())
                  if name.split(".")[0] == "multigpu" and getattr(module, "__file__", None))


def source_hash(sources: list[str]) -> str:
    """What a grid computed from these source files (and this torch and transformers) depends on."""
    import transformers

    root = Path(multigpu.__file__).resolve().parent
    digest = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    for name in sources:
        path = root / name
        digest.update(name.encode() + (path.read_bytes() if path.exists() else b"(gone)"))
    return digest.hexdigest()[:16]


def stamp_of(path: Path) -> tuple[str, list[str]] | None:
    """(hash, source files) that a grid file's first line names, or None (no file, or not a grid)."""
    path = Path(path)
    if not path.exists():
        return None
    with path.open() as f:
        line = f.readline().rstrip("\n")
    if not line.startswith(STAMP) or " of " not in line:
        return None
    found, _, sources = line[len(STAMP):].partition(" of ")
    return found, sources.split()


def is_current(path: Path) -> bool:
    """Whether the grid in `path` was computed from the package's source files and versions as they are now."""
    stamp = stamp_of(path)
    return stamp is not None and stamp[0] == source_hash(stamp[1])


def _entries(label: str, model: str, seq: int) -> dict:
    """The grid's entries for one model at one length (a piece the grid's worker processes share out)."""
    gpt = model_shape(model).family != "t5"
    entries = {}
    for strategy in STRATEGIES if seq == SEQ_LEN else LONG_STRATEGIES:
        tps = TP_DEGREES if gpt and seq == SEQ_LEN and (strategy == "fsdp" or strategy in PIPELINES) else (1,)
        for gpus in (1,) if strategy == "single" else GPU_COUNTS:
            for tp in tps:
                for dtype in DTYPES:
                    for checkpointing in (False, True, "selective"):
                        setup = setup_of(model, strategy, gpus, tp, dtype, checkpointing, seq_len=seq)
                        entries[key(label, strategy, gpus, tp, dtype, checkpointing, seq)] = entry(setup, label)
    return entries


def _piece(label: str, model: str, seq: int) -> tuple[dict, list[str]]:
    """A worker's piece of the grid, and the source files its process has imported so far."""
    return _entries(label, model, seq), _imported_sources()


def _header() -> tuple[dict, list[str]]:
    """What the page reads beside the entries (the choices, the GPUs, the figures' colours), and the source
    files its process has imported."""
    from multigpu.plots import COLORS  # the figures' colours for the categories

    return {
        "seq_len": SEQ_LEN, "seq_lens": [SEQ_LEN, *LONG_SEQ_LENS], "long_strategies": list(LONG_STRATEGIES),
        "microbatches_per_stage": MICROBATCHES_PER_STAGE,
        "categories": list(CATEGORIES), "step_phase": STEP_PHASE,
        "colors": dict(COLORS), "strategies": list(STRATEGIES),
        "gpus": list(GPU_COUNTS), "tp": list(TP_DEGREES), "dtypes": list(DTYPES), "optimizers": list(OPTIMIZERS),
        "recomputation": list(RECOMPUTATION),
        "memory": {name: size for name, size in GPUS.items()},
        "gpu_overhead": {name: gpu_overhead(name) for name in GPUS}, "unnamed_gpu_overhead": gpu_overhead(None),
        "cuda_context": DEFAULT_CUDA_CONTEXT,
    }, _imported_sources()


def grid(workers: int | None = None) -> tuple[dict, list[str]]:
    """(every entry, the source files their computation imported), computed by `workers` spawned processes
    (default: one per core; the pieces are a model at a length, taken in turn), in the same order whatever
    their number. Spawned, also for one worker: a fresh interpreter, not a fork of one that holds torch's
    threads, and one whose imports are the grid's own (what `source_hash` hashes)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with tempfile.TemporaryDirectory() as folder:
        named = models(Path(folder))
        pieces = [(label, model, seq) for label, model in named.items() for seq in (SEQ_LEN, *LONG_SEQ_LENS)
                  if seq == SEQ_LEN or (model_shape(model).family != "t5" and (max_seq_len(model) or 0) >= seq)]
        workers = max(1, min(workers or os.cpu_count() or 1, len(pieces)))
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            header = pool.submit(_header)
            found = list(pool.map(_piece, *zip(*pieces)))
            header, sources = header.result()
        entries = {k: v for part, _ in found for k, v in part.items()}
        sources = sorted(set(sources).union(*(imported for _, imported in found)))
        assert "estimator/calculator.py" in sources, sources  # the entries' own code
        parameters = {label: model_shape(model).parameters for label, model in named.items()}
    import transformers

    made_by = {"package": multigpu.__version__, "source": source_hash(sources), "torch": torch.__version__,
               "transformers": transformers.__version__}
    return {"made_by": made_by, **header, "models": parameters, "entries": entries}, sources


def write(path: Path = GRID_FILE) -> Path:
    """The grid as a script that sets `window.MULTIGPU_GRID`; computed again only when it is not current
    (`is_current`)."""
    path = Path(path)
    if is_current(path):
        return path
    found, sources = grid()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(found, separators=(",", ":"))
    path.write_text(f"{STAMP}{found['made_by']['source']} of {' '.join(sources)}\n"
                    f"window.MULTIGPU_GRID = {text};\n")
    return path


if __name__ == "__main__":  # python -m multigpu.estimator.calculator: the committed grid, computed again if stale
    # through the package's module, not this __main__: the workers then import it by its name, and list it
    from multigpu.estimator import calculator

    print(calculator.write(Path(sys.argv[1]) if len(sys.argv) > 1 else GRID_FILE))
