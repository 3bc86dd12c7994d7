"""Every exercise answer reads correctly for the inputs a reader may type.

An exercise's code cell starts with "# inputs: change them and run again": the reader may change
its first assignment and run it again, and the answer below it is glued from what the cell
computes. This test runs each such cell (after the chapter's setup cell and the earlier cells
that define what it uses, found by reading the code) with the book's inputs and with other sets
of inputs, among them settings where nothing fits, and checks what a reader would read:

- the cell runs (or refuses the inputs with the package's own one-line error);
- it glues every name it glues with the book's inputs (an answer never loses a sentence);
- no glued number is NaN or infinite, no glued text says "nan", "None", "inf" or "0.0 times".
"""

from __future__ import annotations

import ast
import builtins
import math
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```$", re.M | re.S)
INPUTS = "# inputs: change them and run again"
BAD_TEXT = re.compile(r"\b(?i:nan|inf)\b|\bNone\b|\b0\.0+ times\b")

# chapter -> [(alternative first assignment, as a reader would type it)], per input cell, found by
# the names it assigns. "Nothing fits" settings are among them where the cell asks what fits.
ALTERNATIVES = {
    "checkpoints": [
        'model, ranks = "gpt-small", 1',
        "delta_s, mtbf_h = 600, 0.5",
        "steps, every = 100, 100",
    ],
    "choosing": [
        'model_name, strategy, gpus, seq_len, small, large = "gpt2-xl", "fsdp", 2, 1024, 1, 64',
        'model_name, strategy, gpus = "t5-large", "ddp", 1',
        "nodes, gpus_per_node, gpu_memory, fast_links = 1, 2, 16 * GIB, True",  # nothing fits
        'strategy, ranks, model_name, seq_len, batch = "ddp", 4, "gpt-tiny", 64, 8',
    ],
    "collectives": [
        "params, ranks, link = int(7e10), 2, NVLINK4",
        'n, known_mib, asked_mib, algorithm = 2, 1, 256, "ring"',
        'n, known_mib, asked_mib, algorithm = 8, 64, 256, "library"',  # not recorded: refused
        'n, large_mib, model_name, bucket_mb = 2, 16, "gpt-small", 1',
        "n, mib = 2, 1",
        'model_name, seq_len, per_rank, optimizer, world_sizes = ("gpt-small", 64, 2, "adamw", (2, 8))',
    ],
    "cp": [
        "heads, head_dim, seq, c, width = 8, 64, 4096, 2, 4",
        "c = 2",
        "width, layers, heads, positions = 8192, 80, 64, 1024",  # capped at the positions
        "memory, gpus, step = 2 * 2**30, 8, 4096",  # nothing fits
    ],
    "ddp": [
        "samples, ranks = 7, 8",
        'model_name, gpus, seq_len, dtype, per_gpu = "gpt-small", 2, 128, "fp32", 64',
        'model_name, ranks, samples, big_batch, micro_batches = ("gpt-small", 2, 1000, 8, 8)',
        'samples, strategy = 10, "ddp-scratch"',
        'model_name, caps_mb = "gpt-tiny", (25,)',
    ],
    "dp": [
        'new_optimizer = "sgd"',
        'model_name, gpu, gpus, seq_len, optimizer = ("gpt2-xl", "v100-16gb", 2, 2048, "adamw")',  # nothing fits
        'model_name, gpu, gpus, seq_len, optimizer = ("gpt-small", "h100-80gb", 2, 64, "sgd")',
        'model_name, n, batch, seq_len, optimizer = ("gpt-tiny", 2, 4, 64, "adamw")',
    ],
    "fsdp": [
        'model_name, ranks, width = "gpt-small", 2, 2',
        'model_name, gpu, gpus = "t5-3b", "v100-16gb", 2',  # nothing fits
        'model_name, ranks, seq_len, per_rank, width = "gpt-tiny", 4, 64, 1, 2',
    ],
    "moe": [
        "experts, k, seq, factor = 8, 1, 64, 0.5",
        "experts, k, seq, factor = 4, 2, 4096, 4.0",
        "tokens, value_bytes = 1, 4",
        "memory_gb = 1",  # nothing fits
    ],
    "one_device": [
        'model_name, optimizer, gpu = "gpt-small", "sgd", "v100-16gb"',
        'model_name, optimizer, gpu = "gpt2-xl", "adamw", "v100-16gb"',  # nothing fits
        "batch = 1",
        'model_name, batch, seq_len, optimizer = "gpt-tiny", 1, 32, "sgd"',
    ],
    "pp": [
        "p, m, v, target = 2, 1, 1, 0.5",
        "p, m, v, target = 8, 64, 4, 0.01",
        "m_far = 2",
        'model_name, stages, batch, micro, seq_len = "gpt-tiny", 4, 8, 2, 64',
        'model_name, machine, stages = "gpt-small", "8xh100-nvlink", 2',
    ],
    "time": [
        "accum = 1",
        'model, seq, gpus, peak_tflops, tokens_per_s_per_gpu = ("gpt-small", 128, 1, 67, 1)',
        'ck_model, ck_seq = "gpt2", 1024',
    ],
    "together": [
        'grid, gpus_per_node, rank = {"pp": 1, "dp": 4, "tp": 2}, 4, 7',
        'model_name, ranks, replicas, width, batch = "gpt-small", 8, 4, 2, 16',
        'pp_, dp_, tp_, optimizer = 1, 8, 1, "sgd"',
        'model_name, machine = "gpt-small", MACHINES["2x8xh100-100g"]',
    ],
    "tp": [
        'model_name, ranks, seq_len, batch = "gpt-tiny", 4, 64, 2',
        'model_name, gpus, batch, seq_len, act_width, grad_width = ("gpt-small", 2, 1, 64, 4, 4)',
        'h, t, value_bytes, machine = 1024, 2, 4, MACHINES["8xh100-nvlink"]',
    ],
    "zero": [
        'params, ranks, stage, optimizer = int(1e8), 2, 1, "sgd"',
        'params, ranks, gpu, room = int(7e10), 2, "v100-16gb", 0.9',  # nothing fits
        "params, ranks, gpus_per_node, stage = int(1e8), 2, 2, 3",
        'model_name, seq_len, per_rank, world_sizes = "gpt-tiny", 64, 1, (2, 8)',
    ],
}


def cells(chapter: str) -> list[str]:
    text = (ROOT / "book" / f"{chapter}.md").read_text()
    return ["\n".join(line for line in c.splitlines() if not line.startswith(":tags:")) for c in CELL.findall(text)]


def defined(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def used(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def prelude(sources: list[str], index: int) -> list[int]:
    """The cells that cell `index` needs before it: the setup cell (the second; the first checks
    the install) and, for every name it uses and does not define, the last earlier cell that does,
    with what that cell needs in turn."""
    trees = [ast.parse(s) for s in sources]
    known = defined(trees[1]) | set(dir(builtins)) | {"display"}
    needed, todo = set(), [index]
    while todo:
        i = todo.pop()
        for name in used(trees[i]) - defined(trees[i]) - known:
            j = next((j for j in range(i - 1, 1, -1) if name in defined(trees[j])), None)
            assert j is not None, f"cell {i} uses {name}, which no earlier cell defines"
            if j not in needed:
                needed.add(j)
                todo.append(j)
    return [1, *sorted(needed)]


def with_inputs(source: str, assignment: str) -> str:
    """The cell with its first assignment to the same names replaced by `assignment`."""
    new = ast.parse(assignment).body[0]
    names = ast.dump(new.targets[0])
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and ast.dump(node.targets[0]) == names:
            lines = source.splitlines()
            lines[node.lineno - 1:node.end_lineno] = [assignment]
            return "\n".join(lines)
    raise LookupError(f"no input cell assigns {names}")


def sweep_cases():
    for chapter, alternatives in ALTERNATIVES.items():
        for assignment in alternatives:
            yield pytest.param(chapter, assignment, id=f"{chapter}: {assignment[:40]}")


def run(chapter: str, index: int, source: str) -> dict:
    """Run cell `index` of the chapter (as `source`) after its prelude; what it glued."""
    from multigpu.errors import ConfigError

    sources = cells(chapter)
    glued: dict = {}
    namespace: dict = {"__name__": "__chapter__"}
    for i in prelude(sources, index):
        exec(compile(sources[i], f"{chapter}.md cell {i}", "exec"), namespace)  # noqa: S102
        namespace["glue"] = lambda name, value, display=True: None  # the earlier cells' glue
        namespace["display"] = lambda *args, **kwargs: None
    namespace["glue"] = lambda name, value, display=True: glued.__setitem__(name, value)
    try:
        exec(compile(source, f"{chapter}.md cell {index}", "exec"), namespace)  # noqa: S102
    except ConfigError as refused:  # the package refusing inputs it cannot take, in one line
        return {"refused": str(refused)}
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
    return glued


def problems(glued: dict) -> list[str]:
    found = []
    for name, value in glued.items():
        if isinstance(value, float) and not math.isfinite(value):
            found.append(f"{name} = {value}")
        elif isinstance(value, str) and BAD_TEXT.search(value):
            found.append(f"{name}: {value!r}")
    return found


@pytest.fixture(autouse=True)
def in_book_dir(monkeypatch):
    """Chapters run from book/, as Jupyter Book runs them; traces are cached where make book keeps them."""
    monkeypatch.chdir(ROOT / "book")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    if (ROOT / "_build" / "traces").is_dir() and "MULTIGPU_TRACE_CACHE" not in os.environ:
        monkeypatch.setenv("MULTIGPU_TRACE_CACHE", str(ROOT / "_build" / "traces"))


@pytest.mark.parametrize(("chapter", "assignment"), list(sweep_cases()))
def test_an_answer_reads_correctly_for_other_inputs(chapter, assignment):
    sources = cells(chapter)
    target = ast.dump(ast.parse(assignment).body[0].targets[0])
    index = next(i for i, s in enumerate(sources) if INPUTS in s and any(
        isinstance(n, ast.Assign) and ast.dump(n.targets[0]) == target for n in ast.parse(s).body))
    as_written = run(chapter, index, sources[index])
    assert "refused" not in as_written and not problems(as_written), (chapter, as_written)
    changed = run(chapter, index, with_inputs(sources[index], assignment))
    if "refused" in changed:
        assert "\n" not in changed["refused"].strip(), changed["refused"]
        return
    lost = set(as_written) - set(changed)
    assert not lost, f"{chapter}: with {assignment}, the answer loses {sorted(lost)}"
    assert not problems(changed), f"{chapter}: with {assignment}: {problems(changed)}"


def test_every_input_cell_is_swept():
    """Each cell that invites the reader to change its inputs has at least one other set here."""
    unswept = []
    for chapter in sorted({p.stem for p in (ROOT / "book").glob("*.md")}):
        targets = {ast.dump(ast.parse(a).body[0].targets[0]) for a in ALTERNATIVES.get(chapter, [])}
        for i, source in enumerate(cells(chapter)):
            if INPUTS in source and not any(isinstance(n, ast.Assign) and ast.dump(n.targets[0]) in targets
                                            for n in ast.parse(source).body):
                unswept.append(f"{chapter} cell {i}")
    assert not unswept, f"input cells with no other inputs in ALTERNATIVES: {unswept}"
