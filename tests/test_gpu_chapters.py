"""Every chapter built from the records of GPU servers (tests/gpu_shaped.py), written without
a GPU: 2 GPUs and a partial folder (3 GPUs whose pipeline and tensor-parallel runs failed) in
every `make test`; 1 and 3 GPUs and 8 with MULTIGPU_TEST_GPU_SERVERS=all (a command, below).

Chapters are executed as the book executes them, with MULTIGPU_RESULTS pointing at the
GPU-shaped results and the kernel itself on the fake server (tests/fake_cuda/sitecustomize.py:
its torch.cuda, machine tag and `executed_here` are the server's): every cell that reads
records (`record_cells`: all but those that start processes, and what reads their results;
what those compute does not depend on the records). A chapter builds when no cell fails and
nothing it shows the reader (glued text, printed lines, Markdown, tables, captions) says nan,
inf or None. Whole chapters, live cells too, take longer than CI allows and need real GPUs for
their launches; MULTIGPU_TEST_WHOLE_CHAPTERS=1 runs them on this machine's CPU (the kernel not
faked).

    # the other servers' chapters (about 6 minutes a server on 2 cores)
    MULTIGPU_TEST_GPU_SERVERS=all .venv/bin/python -m pytest tests/test_gpu_chapters.py
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

from gpu_shaped import SERVERS, kernel_env, server_results
from multigpu import records

BOOK = Path(__file__).resolve().parents[1] / "book"
EVERY_RUN = ["2xH100", "3xV100-partial"]  # each server's chapters cost minutes: two in `make test`
ON_REQUEST = [s for s in SERVERS if s not in EVERY_RUN]
READ_BY_CHAPTERS = EVERY_RUN + (ON_REQUEST if os.environ.get("MULTIGPU_TEST_GPU_SERVERS") == "all" else [])


@pytest.fixture(scope="session")
def gpu_results(tmp_path_factory):
    """gpu_results(server) -> (folder, GPU tag), written once per session (tests/gpu_shaped.py)."""
    return lambda server: server_results(server, tmp_path_factory)


# calls that start processes, or train in this one (a dry run: seconds each, and reading no records)
LIVE = {"launch", "launch_series", "check", "check_all", "check_series", "run_spmd", "dry_run", "dry_runs", "held"}


def _names(code: str) -> tuple[set[str], set[str], set[str]]:
    """(names read but not bound, names bound, functions called) in a cell's code."""
    read, bound, called = set(), set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Call):
            called.add(node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
    return read - bound, bound, called


def record_cells(cells: list) -> list:
    """The code cells that do not start processes, nor read what such a cell made (a name a
    cell both reads and binds counts as its own)."""
    kept, tainted = [], set()
    for cell in cells:
        if cell.cell_type != "code":
            kept.append(cell)
            continue
        free, bound, called = _names(cell.source)
        if called & LIVE or free & tainted:
            tainted |= bound
        else:
            tainted -= bound
            kept.append(cell)
    return kept


SPY = """\
import multigpu.plots.style as _style, multigpu.records as _records
# the originals, kept on the module: a kernel that executed another chapter has the spies in place
_records._unspied = getattr(_records, "_unspied", (_records.caption, _records.load))
_captions, _loaded, _loads = [], [], []
_caption, _load = _records._unspied
def _spy_caption(runs):
    _captions.append(_caption(runs))
    return _captions[-1]
def _spy_load(experiment, tag=None, needs=None):
    runs = _load(experiment, tag, needs)
    if tag is None:  # the richest machine's records, which the chapter shows
        _loaded.append(runs[0]["provenance"]["machine_tag"])
    # which cell read records of which devices
    _loads.append([get_ipython().execution_count, sorted({r["provenance"]["device_type"] for r in runs})])
    return runs
_records.caption = _style.caption = _spy_caption  # the figures caption through style
_records.load = _spy_load
"""
REPORT = ("import json; print(json.dumps({'captions': _captions, 'loaded': _loaded, 'loads': _loads, "
          "'here': _records.machine_tag()}))")
GLUE = re.compile(r"\{glue:text\}`([^`]+)`")
TABLE_CELL = re.compile(r"<t[dh][^>]*>([^<]*)</t[dh]>")
UNDEFINED = re.compile(r"\b([Nn]a[Nn]|inf|None)\b")  # a number that is not one, a value that is not there
# what only a CPU run has or lacks: its vector instructions, the resident set, the C library's
# allocator, gloo's loopback traffic; and a GPU's something "not measured here", which measured CUDA
# records contradict (NCCL's bytes on the wire are not measured anywhere: no GPU or CUDA before it)
CPU_ONLY = re.compile(r"\bavx|resident set|C library|loopback|(GPU|CUDA).{0,80}not measured here", re.IGNORECASE)


def execute(chapter: Path, results: Path, monkeypatch, whole: bool, kernels: dict | None = None,
            server: str | None = None):
    """The chapter as the book executes it (every cell, or only `record_cells`), reading
    `results`; first and last, cells that log every caption and every records.load.

    `kernels`: a server's kernel is started once and kept there for its next chapters, each
    begun by `%reset -f` (a kernel's start and imports cost seconds a chapter); the environment
    it was started with (the server, `results`) is the same for all of them. A chapter that
    fails gives its kernel up: the next one starts afresh."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = jupytext.read(chapter)
    cells = nb.cells if whole else record_cells(nb.cells)
    nb.cells = [nbformat.v4.new_code_cell("%reset -f\n" + SPY), *cells, nbformat.v4.new_code_cell(REPORT)]
    monkeypatch.setenv("MULTIGPU_RESULTS", str(results))
    monkeypatch.setenv("MULTIGPU_PROGRESS", "0")
    km = None if kernels is None else kernels.get(server)
    client = NotebookClient(nb, km=km, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(BOOK)}})
    try:
        client.execute(cleanup_kc=kernels is None)
    except BaseException:
        if kernels is not None:
            _shut_down(kernels.pop(server, None) or client.km)
        raise
    if kernels is not None:
        kernels[server] = client.km
    return nb


def _shut_down(km) -> None:
    from nbclient.util import run_sync

    if km is not None and km.has_kernel:
        run_sync(km.shutdown_kernel)(now=True)


@pytest.fixture(scope="module")
def kernels():
    """One notebook kernel per server for the chapters' record cells (`execute`), shut down after."""
    kept: dict = {}
    yield kept
    for km in kept.values():
        _shut_down(km)


def prose(nb) -> list[tuple[int, str, str]]:
    """What a reader reads that the code wrote, as (the code cell that wrote it, where, text):
    every {glue:text} as the book renders it, what cells print, the Markdown they display and
    the tables they show (a DataFrame's text; a styled table's cells, from its HTML)."""
    from myst_nb.core.variables import format_plain_text
    from myst_nb.ext.glue import GLUE_PREFIX

    glued, texts = {}, []
    for i, cell in enumerate(nb.cells[:-1]):  # the last is REPORT's
        for out in cell.get("outputs", []):
            if "scrapbook" in out.get("metadata", {}):
                glued[out.metadata.scrapbook.name] = i, out.data[GLUE_PREFIX + "text/plain"]
            elif out.output_type == "stream" and out.name == "stdout":
                texts.append((i, "printed", out.text))
            elif out.output_type in ("display_data", "execute_result") and "text/markdown" in out.get("data", {}):
                texts.append((i, "markdown", out.data["text/markdown"]))
            elif out.output_type in ("display_data", "execute_result") and "text/html" in out.get("data", {}):
                table = out.data.get("text/plain") if "DataFrame" not in out.data.get("text/plain", "Styler") \
                    else None  # a Styler's text is its repr: its cells are in the HTML
                texts.append((i, "table", table or " ".join(TABLE_CELL.findall(out.data["text/html"]))))
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for ref in GLUE.findall(cell.source):
                key, fmt = ref.rsplit(":", 1) if ":" in ref else (ref, "s")
                if key in glued:  # a glue of a skipped live cell is not rendered here
                    texts.append((glued[key][0], ref, format_plain_text(glued[key][1], fmt)))
    return texts


def cells_reading_cuda(nb, loads: list) -> set[int]:
    """The code cells whose text is about CUDA records: those that loaded records of CUDA runs
    only, and those after them that load nothing themselves (they go on with what was loaded
    last, as one_device.md's precision table does with the techniques' runs). A cell that
    loads CPU records, or both, is not one."""
    devices: dict[int, set[str]] = {}
    for count, kinds in loads:
        devices.setdefault(count, set()).update(kinds)
    reading, current = set(), set()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            current = devices.get(cell.get("execution_count"), current)
            if current == {"cuda"}:
                reading.add(i)
    return reading


def chapters_reading_records() -> list:
    """Every chapter with code that reads records (itself, or a foot that names the machine)."""
    return sorted(p.stem for p in BOOK.glob("*.md") if "records." in p.read_text())


def test_record_cells_keep_every_cell_that_loads_records():
    import jupytext

    for chapter in BOOK.glob("*.md"):
        cells = jupytext.read(chapter).cells
        kept = record_cells(cells)
        assert not [c.source for c in cells if c not in kept and "records." in c.source], chapter.stem


def _check_chapter(chapter: str, server: str, whole: bool, gpu_results, monkeypatch, kernels=None) -> None:
    """Execute the chapter against the GPU-shaped results in a kernel on the fake server (not
    for whole chapters: their launches would need the GPUs): no error; no nan, inf or None in
    what it writes for the reader; no CPU-only words in what its code writes about CUDA
    records; captions that name the GPU machine whose records it shows; the kernel's own
    machine is the server."""
    folder, tag = gpu_results(server)
    gpus, name, *_ = SERVERS[server]
    if not whole:
        kernel_env(monkeypatch, gpus, name)
    nb = execute(BOOK / f"{chapter}.md", folder, monkeypatch, whole, kernels, server)
    log = json.loads(nb.cells[-1].outputs[-1].text)
    written = prose(nb)
    wrong = [f"{where}: {text}" for _, where, text in written if UNDEFINED.search(text)]
    assert not wrong, f"{chapter} says nan, inf or None:\n" + "\n".join(wrong)
    assert not [c for c in log["captions"] if UNDEFINED.search(c)]
    about_cuda = cells_reading_cuda(nb, log["loads"])
    cpu_words = [f"{where}: {text}" for i, where, text in written if i in about_cuda and CPU_ONLY.search(text)]
    assert not cpu_words, f"{chapter} says CPU things of CUDA records:\n" + "\n".join(cpu_words)
    if tag in log["loaded"]:  # shows the GPU server's records: some figure says so
        assert any(c.startswith(f"Measured on {tag} (") for c in log["captions"]), log["captions"]
    assert log["here"] == (records.machine_tag() if whole else tag)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("server", READ_BY_CHAPTERS)
@pytest.mark.parametrize("chapter", chapters_reading_records())
def test_chapter_builds_from_gpu_records(chapter, server, gpu_results, monkeypatch, kernels):
    _check_chapter(chapter, server, False, gpu_results, monkeypatch, kernels)


@pytest.mark.skipif(not os.environ.get("MULTIGPU_TEST_WHOLE_CHAPTERS"),
                    reason="every cell, live ones too: about as long as `make book` per server (14 minutes "
                           "on 2 cores), more than CI allows; MULTIGPU_TEST_WHOLE_CHAPTERS=1 runs it")
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("server", READ_BY_CHAPTERS)
@pytest.mark.parametrize("chapter", chapters_reading_records())
def test_whole_chapter_builds_against_gpu_records(chapter, server, gpu_results, monkeypatch):
    _check_chapter(chapter, server, True, gpu_results, monkeypatch)
