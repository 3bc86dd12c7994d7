"""The GPU path, proven without a GPU: the records servers with CUDA GPUs write
(tests/gpu_shaped.py), and every chapter's record-reading code run against them.

The servers: 8 H100s (a complete `make figures`), 3 V100s whose pipeline and tensor-parallel
runs failed (a partial one: chapters then mix the GPU's records with the committed CPU's),
1 and 16 A100s. Every server's experiment lists, records and folders are checked; the
chapters, which take tens of seconds each, are executed against the first two only.

Chapters are executed as the book executes them, with MULTIGPU_RESULTS pointing at the
GPU-shaped results and the kernel itself on the fake server (tests/fake_cuda/sitecustomize.py:
its torch.cuda, machine tag and `executed_here` are the server's): every cell that reads
records (`record_cells`: all but those that start processes, and what reads their results).
Whole chapters, live cells too, take longer than CI allows and need real GPUs for their
launches; MULTIGPU_TEST_WHOLE_CHAPTERS=1 runs them on this machine's CPU (the kernel not faked).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_shaped import (
    A100,
    COMMITTED,
    H100,
    V100,
    fake_cuda,
    gpu_train_result,
    kernel_env,
    pipelines_fail,
    template,
    training_records,
    write_gpu_results,
)
from multigpu import experiments, records, runtime
from multigpu.config import RunConfig
from multigpu.experiments import EXPERIMENTS, Job
from multigpu.memory import CATEGORIES

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"

# name -> (GPUs, their name, the runs that fail in their workers), and the tag its records go to
SERVERS = {
    "8xH100": (8, H100, None),
    "3xV100-partial": (3, V100, pipelines_fail),
    "1xA100": (1, A100, None),
    "16xA100": (16, A100, None),
}
TAGS = {"8xH100": "8xH100-nccl", "3xV100-partial": "3xV100-SXM2-32GB-nccl", "1xA100": "1xA100-SXM4-80GB-nccl",
        "16xA100": "16xA100-SXM4-80GB-nccl"}
READ_BY_CHAPTERS = ["8xH100", "3xV100-partial"]  # each chapter pass costs tens of seconds: two servers
TRAINING = [e for e in EXPERIMENTS if not any(isinstance(item, Job) for item in EXPERIMENTS[e]())]


@pytest.fixture(scope="session")
def gpu_results(tmp_path_factory):
    """gpu_results(server) -> (folder, GPU tag): results/ as that server (SERVERS) leaves it,
    written once per session."""
    made = {}

    def results(server: str) -> tuple[Path, str]:
        if server not in made:
            folder = tmp_path_factory.mktemp(f"results-{server}")
            made[server] = folder, write_gpu_results(folder, *SERVERS[server])
        return made[server]

    return results


# -- the stand-in for train() ------------------------------------------------------------

@pytest.fixture(scope="module")
def train_result_keys() -> set[str]:
    """The keys of what train() really returns (one step of gpt-tiny, in this process)."""
    from multigpu.train import train

    cfg = RunConfig(steps=1, global_batch_size=2, dataset="dummy").validate()
    return set(train(cfg, runtime.Runtime(0, 0, 1, torch.device("cpu"), "gloo")))


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero3", "dp", "pp-1f1b"])
def test_the_stand_in_returns_what_train_returns(strategy, train_result_keys):
    cfg = RunConfig(strategy=strategy, world_size=1 if strategy == "single" else 2, model="gpt2",
                    global_batch_size=8, seq_len=256, device="cuda")
    committed = training_records(COMMITTED)
    assert set(gpu_train_result(cfg, 0, template(cfg, None, committed))) == train_result_keys


# -- the experiment lists, by GPU count -----------------------------------------------------------

# (ddp_scaling, dp_vs_ddp, sharded_memory_comm, tp_scaling) runs, and tp_scaling's degrees, as the
# reviews counted them (F3, G5): on 1 GPU the multi-process experiments are the CPU's
LISTS = {1: ((7, 7, 25, 17), {2, 4}), 2: ((5, 4, 13, 9), {2}), 3: ((5, 7, 25, 9), {2}),
         8: ((9, 7, 25, 17), {2, 8}), 16: ((11, 7, 25, 17), {2, 8})}


@pytest.mark.parametrize("gpus", sorted(LISTS))
def test_experiment_lists_are_sized_for_the_gpus(gpus, monkeypatch):
    fake_cuda(monkeypatch, gpus)
    sizes = tuple(len(EXPERIMENTS[e]()) for e in ("ddp_scaling", "dp_vs_ddp", "sharded_memory_comm", "tp_scaling"))
    degrees = {cfg.world_size for cfg in EXPERIMENTS["tp_scaling"]() if cfg.world_size > 1}
    assert (sizes, degrees) == LISTS[gpus]
    assert experiments.ddp_device() == ("cpu" if gpus == 1 else "cuda")


@pytest.mark.parametrize("gpus", sorted(LISTS))
@pytest.mark.parametrize("experiment", TRAINING)
def test_every_run_sized_for_gpus_is_valid(experiment, gpus, monkeypatch):
    """What `launch` checks first, for every run an experiment makes on 1, 2, 3, 8 and 16
    GPUs, as multigpu.experiments sizes them: the config, and a device plan that gives each rank
    (or DataParallel replica) its own GPU."""
    fake_cuda(monkeypatch, gpus)
    for cfg in EXPERIMENTS[experiment]():
        cfg.validate()
        plan = runtime.device_plan(cfg)
        assert plan.device == (cfg.device if cfg.device != "auto" else "cuda"), (cfg, plan.why)
        if plan.device == "cuda":  # a GPU for every rank, or every DataParallel replica
            assert len(plan.gpus) == (cfg.world_size if cfg.info.one_process else cfg.processes) <= gpus


def test_the_cpu_pin_holds_on_a_gpu_machine_and_the_fake_server_lifts_it(monkeypatch):
    """conftest's MULTIGPU_DEVICE=cpu: on a machine with 8 GPUs the tests still check CPU facts;
    fake_cuda lifts it, as on a server where nothing sets it."""
    assert os.environ[runtime.DEVICE_ENV] == "cpu"
    fake_cuda(monkeypatch, 8)
    assert runtime.choose_device("auto", 2)[:2] == ("cuda", "nccl") and experiments.on_gpus(8)
    monkeypatch.setenv(runtime.DEVICE_ENV, "cpu")
    assert runtime.choose_device("auto", 2)[:2] == ("cpu", "gloo")  # the pin, on the GPU machine
    assert runtime.device_plan(RunConfig(strategy="ddp", world_size=4)).device == "cpu"
    assert runtime.choose_device("cuda", 2)[0] == "cuda"  # asked for by name, the GPUs are there
    assert not experiments.on_gpus(2) and experiments.ddp_device() == "cpu"


def test_the_fake_server_reaches_the_processes_a_test_starts(monkeypatch):
    """A kernel (here a plain interpreter) started with kernel_env answers for the server: its
    torch.cuda, machine tag, the experiments' GPUs, cores, and the line at a chapter's foot."""
    kernel_env(monkeypatch, 16, V100)
    code = ("import os, torch; from multigpu import experiments, records; "
            "print(torch.cuda.device_count(), records.machine_tag(), experiments.gpus_here(), os.cpu_count(), "
            "torch.cuda.get_device_capability(), sep='|'); print(records.executed_here())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    facts, here = out.splitlines()
    assert facts == "16|16xV100-SXM2-32GB-nccl|16|32|(7, 0)"
    assert " on 16xV100-SXM2-32GB-nccl (16 x Tesla V100-SXM2-32GB, CUDA 12.8) with torch " in here
    assert "+cu128" in here and "no GPU" not in here


def test_without_the_variable_the_fake_changes_nothing():
    from fake_cuda.sitecustomize import install

    before = (torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__, os.cpu_count())
    install({})
    assert (torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__, os.cpu_count()) == before


# -- the records ---------------------------------------------------------------------------

def _failing(server: str, experiment: str, cfg) -> bool:
    fails = SERVERS[server][2]
    return bool(fails and fails(experiment, cfg))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("server", SERVERS)
def test_gpu_records_are_shaped_like_the_gpu_path(gpu_results, server):
    folder, tag = gpu_results(server)
    gpus, name, _ = SERVERS[server]
    assert tag == TAGS[server]
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, gpus, name)
        made = {e: [c for c in EXPERIMENTS[e]() if not _failing(server, e, c)] for e in TRAINING}
    runs = 0
    for path in sorted((folder / tag).glob("*.jsonl")):
        found = records.read_records(path)
        if path.stem in made:
            assert len(found) == len(made[path.stem]), path.stem  # every run but those that failed
        for r in found:
            p = r["provenance"]
            assert p["machine_tag"] == tag and p["device_type"] == "cuda" and p["cuda"] and p["nccl"]
            assert p["device_names"] == [name] * gpus
            if r.get("kind") in ("matmul", "memory"):  # machine_limits: the GPU's own peaks
                assert r["best_flops_per_s" if r["kind"] == "matmul" else "best_bytes_per_s"] > 0
                continue
            if "loss" not in r:  # largest_batch, cp_longest: a job's measurement, probes of runs
                assert r["probes"] and (r["per_rank_batch"] > 0 if "per_rank_batch" in r else r["predicted"] > 0)
                continue
            runs += path.stem in made  # (compositions: a job whose measurements are runs)
            cfg = RunConfig.from_dict(r["config"])
            assert p["backend"] == ("threads" if cfg.strategy == "dp" else "nccl")
            assert r["loopback_bytes_per_step"] is None  # measured over gloo only
            assert all(isinstance(b, int) and b > 0 for b in r["cuda_allocator_peak_bytes_by_rank"])
            assert len(r["peak_memory_bytes_by_rank"]) == cfg.world_size
            for peak in r["peak_memory_bytes_by_rank"]:
                assert set(peak) == {*CATEGORIES, "total"}
                if cfg.strategy == "dp":  # GPUDataParallel: each device's allocator, no categories
                    assert [peak[c] for c in CATEGORIES] == [None] * len(CATEGORIES) and peak["total"] > 0
                elif cfg.info.module == "pp":  # the library's pipelines: the tracker cannot follow them
                    assert set(peak.values()) == {None}
                else:
                    assert peak["total"] == sum(peak[c] for c in CATEGORIES)
    # every run of every training experiment sized for the GPUs is there
    assert runs == sum(len(cfgs) for e, cfgs in made.items() if (folder / tag / f"{e}.jsonl").exists()) > 0


RUN_SPMD = {"collectives_bandwidth", "link_model", "tp_width", "tp_collectives", "pp_bubble", "async_staleness",
            "cp_balance", "cp_timeline", "cp_longest", "checkpoint_bytes"}  # the CPU by design (cp_balance: the
# ring's blocks replayed in one process; cp_longest: a CPU budget for gpt-long, whose positions fit any GPU;
# checkpoint_bytes: a layout's bytes, the same on any device)
ONE_DEVICE = {"one_device_memory", "one_device_techniques", "machine_peak", "t5_largest_batch", "moe_balance",
              "moe_capacity", "checkpoint_cost", "machine_limits", "step_profiles", "recomputation"}


@pytest.mark.parametrize("server", SERVERS)
def test_gpu_server_files_cpu_experiments_under_its_cpu_tag(gpu_results, server):
    """What runs on the CPU by design (run_spmd, the replay; on 1 GPU every multi-process
    experiment; the compositions below 8 GPUs) is filed under the server's CPU tag, never under
    the GPU's; an experiment whose every run failed has no folder but the committed one."""
    folder, tag = gpu_results(server)
    gpus = SERVERS[server][0]
    on_cpu = {p.stem for p in (folder / "cpu-32core-gloo").glob("*.jsonl")}
    on_gpus = {p.stem for p in (folder / tag).glob("*.jsonl")}
    assert on_cpu == (set(EXPERIMENTS) - ONE_DEVICE if gpus == 1 else
                      RUN_SPMD | ({"compositions"} if gpus < 8 else set()))
    missing = {"pp_schedules", "pp_memory", "tp_scaling"} if server.endswith("partial") else set()
    assert on_cpu | on_gpus == set(EXPERIMENTS) - missing and not on_cpu & on_gpus
    assert all((folder / COMMITTED.name / f"{e}.jsonl").exists() for e in missing)  # what chapters fall back to
    assert sorted(p.name for p in folder.iterdir()) == sorted({COMMITTED.name, "cpu-32core-gloo", tag})


# one cuBLAS workspace per handle, two handles (the forward's thread and autograd's): 32 MiB each on
# Hopper, 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB on Volta and Ampere (torch 2.13, CublasHandlePool.cpp)
WORKSPACES = {H100: 2 * 32 * 2**20, A100: 2 * (8 * 2**20 + 128 * 2**10), V100: 2 * (8 * 2**20 + 128 * 2**10)}


@pytest.mark.parametrize("server", ["8xH100", "3xV100-partial", "16xA100"])
def test_the_estimate_of_a_gpu_record_counts_its_gpus_cublas_workspaces(gpu_results, server):
    """The estimator's question for a GPU record (accuracy.setup_of, held against the allocator)
    adds the workspaces of that GPU: the 32 MiB branch on an H100, the 8.125 MiB one on an A100
    or a V100 (review F4, G10)."""
    from multigpu.estimator.accuracy import setup_of

    folder, tag = gpu_results(server)
    setups = [setup_of(r) for path in (folder / tag).glob("*.jsonl") for r in records.read_records(path)
              if "config" in r]
    setups = [s for s in setups if s is not None]
    assert len(setups) > 20
    assert {(s.on_cuda, s.cuda_workspace_bytes) for s in setups} == {(True, WORKSPACES[SERVERS[server][1]])}


@pytest.mark.parametrize("server", ["8xH100", "3xV100-partial"])
def test_the_estimators_record_readers_on_a_gpu_server(gpu_results, server, monkeypatch, capsys):
    """The key assertions of the tests that read the committed records (test_estimate,
    test_calibration, test_advise; they read the committed CPU folder only, review G4b), with
    what a GPU server's results/ should give instead:
    - against_records: rows for the GPU's tracked runs, none for DataParallel or the library's
      pipelines (no categories on GPUs); the committed CPU's rows as before;
    - the machine's calibration: the GPU's from its allocator peaks, the CPU's from CPU folders
      only; `estimate --gpu` applies the GPU's and says so;
    - the 2-process runs the step-time model is compared with come from the GPU where it has
      them, and the link it is fitted with stays a CPU's (no GPU experiment fits one)."""
    from multigpu import __main__ as cli
    from multigpu.estimator.accuracy import CALIBRATED_BY, against_records, machine_calibration
    from multigpu.estimator.step_time import recorded_machine

    folder, tag = gpu_results(server)
    monkeypatch.setattr(records, "RESULTS_DIR", folder)
    every = [r for path in sorted(folder.glob("*/*.jsonl")) for r in records.read_records(path) if "config" in r]
    rows = against_records(every)
    on_gpu = {row["strategy"] for row in against_records([r for r in every
                                                          if r["provenance"]["device_type"] == "cuda"])}
    assert on_gpu >= {"single", "ddp", "zero1", "zero2", "zero3", "fsdp"} and not on_gpu & {"dp", "pp-1f1b", "pp-gpipe"}
    assert all(math.isfinite(row["total_error"]) for row in rows)
    committed = against_records([r for r in every if r["provenance"]["machine_tag"] == COMMITTED.name])
    assert {row["strategy"] for row in committed} >= {"dp", "pp-1f1b-scratch"} and len(rows) > len(committed)

    gpu_fit, cpu_fit = machine_calibration("cuda"), machine_calibration("cpu")
    assert gpu_fit is not None and gpu_fit.source == f"{CALIBRATED_BY} on {tag}"
    assert cpu_fit is not None and tag not in cpu_fit.source
    assert cli.main(["estimate", "--model", "t5-small", "--gpu", "v100-32gb", "--batch-size", "2"]) == 0
    said = capsys.readouterr().out
    assert "the machine's own peak, calibrated" in said and tag in said and "no cuda machine" not in said

    two = [r for name in ("sharded_memory_comm", "tp_scaling", "pp_schedules") for r in records.load(name)
           if "config" in r and r["config"]["world_size"] == 2]
    from_gpu = {r["config"]["strategy"] for r in two if r["provenance"]["machine_tag"] == tag}
    assert from_gpu >= {"ddp", "fsdp"} and ({"tp", "pp-1f1b", "pp-gpipe"} <= from_gpu) == (server == "8xH100")
    assert recorded_machine(2).name.startswith("cpu-")


# -- the chapters ------------------------------------------------------------------------------

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
def _spy_load(experiment, tag=None):
    runs = _load(experiment, tag)
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
    every {glue:text} as the book renders it, what cells print and the Markdown they display."""
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
    names = sorted(p.stem for p in BOOK.glob("*.md") if "records.load(" in p.read_text())
    return names


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
    gpus, name, _ = SERVERS[server]
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
def test_chapter_reads_gpu_records(chapter, server, gpu_results, monkeypatch, kernels):
    _check_chapter(chapter, server, False, gpu_results, monkeypatch, kernels)


@pytest.mark.skipif(not os.environ.get("MULTIGPU_TEST_WHOLE_CHAPTERS"),
                    reason="every cell, live ones too: 5 to 6 minutes per server on 2 cores, more than CI "
                           "allows; MULTIGPU_TEST_WHOLE_CHAPTERS=1 runs it")
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("server", READ_BY_CHAPTERS)
@pytest.mark.parametrize("chapter", chapters_reading_records())
def test_whole_chapter_builds_against_gpu_records(chapter, server, gpu_results, monkeypatch):
    _check_chapter(chapter, server, True, gpu_results, monkeypatch)
