"""`make gpu-check`: the GPU path, run for real on this machine's CUDA GPUs (under 10 minutes).

`make test` keeps every run on the CPU (conftest's MULTIGPU_DEVICE=cpu), so on a GPU machine it
never starts a tensor-parallel, pipeline, DeepSpeed, FSDP or composed run over NCCL. This
module does, at the machine's GPU count G: two steps of every strategy family, each compared
with one GPU's run (`check`), at the largest world size up to G that the strategy takes with
the tiny models; the memory estimator against the CUDA caching allocator's peak; and the live
cells of the chapters that start GPU runs (one_device.md, pp.md, together.md), executed whole
in a notebook kernel that reads a temporary copy of results/ and does not inherit the test
suite's CPU pin, so that their `device="auto"` reaches the GPUs.

Whatever needs more GPUs than the machine has is skipped with the count it needs; without
CUDA every test is skipped. pytest does not collect this file (it is not test_*.py):

    make gpu-check                                   # .venv/bin/python -m pytest tests/gpu_check.py
    MULTIGPU_GPU_CHECK_ON_CPU=2 .venv/bin/python -m pytest tests/gpu_check.py   # self-check, no GPU

MULTIGPU_GPU_CHECK_ON_CPU=N runs the same tests on the CPU (gloo) as if the machine had N
devices, so that this module's own logic is exercised where there is no GPU; the comparison
with the CUDA allocator is then skipped (there is none). A summary to paste into an issue
(GPUs, versions, every check's differences) is printed at the end and written to
_build/gpu-check/summary.md and summary.json.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from multigpu.check import BF16_TOLERANCE, check
from multigpu.config import RunConfig
from multigpu.launch import launch
from multigpu.profiling import CATEGORIES
from multigpu.runtime import DEVICE_ENV

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "_build" / "gpu-check"
ON_CPU_ENV = "MULTIGPU_GPU_CHECK_ON_CPU"
STEPS = 2
TOLERANCE = 1e-5  # fp32: the CPU suite's parity tolerance (tests/test_parity.py)
ALLOCATOR_TOLERANCE = 0.10  # the estimate against the allocator's peak (tests/test_estimate.py)


def _machine() -> tuple[str | None, int, str]:
    """(device the checks run on or None, device count G, how this run is described)."""
    raw = os.environ.get(ON_CPU_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{ON_CPU_ENV}={raw!r}: give the number of devices to pretend, e.g. 2")
        n = int(raw)
        return "cpu", n, f"self-check on the CPU (gloo) as if there were {n} devices ({ON_CPU_ENV}={n})"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None, 0, (f"no CUDA GPU here (torch {torch.__version__}, CUDA build: {torch.version.cuda}): "
                         f"make gpu-check needs a machine with CUDA GPUs; {ON_CPU_ENV}=2 runs the same "
                         "checks on the CPU as a self-check")
    return "cuda", torch.cuda.device_count(), f"{torch.cuda.device_count()} CUDA GPU(s)"


DEVICE, GPUS, MACHINE = _machine()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=MACHINE)


def _needs(count: int, what: str) -> None:
    if GPUS < count:
        pytest.skip(f"{what} needs {count} GPUs, this machine has {GPUS}" if DEVICE == "cuda" else
                    f"{what} needs {count} devices, the self-check pretends {GPUS} ({ON_CPU_ENV}={GPUS})")


# -- the summary -----------------------------------------------------------------------------

ROWS: list[dict] = []
SEEN: dict = {}  # the first record's provenance: what the workers saw (GPU names, versions)


@contextmanager
def recorded(name: str, **fields):
    """One row of the summary: filled by the test, marked skipped, failed or errored by how the
    test ends, timed."""
    row = {"check": name, "world_size": None, "device": None, "detail": "", **fields}
    start = time.monotonic()
    try:
        yield row
    except pytest.skip.Exception as skipped:
        row["result"] = "skipped"
        row["detail"] = skipped.msg
        raise
    except AssertionError:
        row.setdefault("result", "FAILED")
        raise
    except BaseException as err:
        row["result"] = "ERROR"
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [""]
        said = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # a traceback's last line: the error
        row["detail"] = ((row["detail"] + "; " if row["detail"] else "") + f"{type(err).__name__}: {said}")[:400]
        raise
    else:
        row.setdefault("result", "passed")
    finally:
        row["seconds"] = round(time.monotonic() - start, 1)
        ROWS.append(row)


def _note(record: dict) -> None:
    if not SEEN and record.get("provenance"):
        SEEN.update(record["provenance"])


def _gpu_lines() -> list[str]:
    """nvidia-smi's view of the GPUs (names, driver, memory); [] without it."""
    smi = shutil.which("nvidia-smi")
    if DEVICE != "cuda" or not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _header() -> dict:
    facts = {"machine": MACHINE, "devices": GPUS, "torch": torch.__version__, "python": platform.python_version(),
             "cpu_count": os.cpu_count(), "git_commit": SEEN.get("git_commit")}
    if DEVICE == "cuda":
        facts["cuda"] = torch.version.cuda
        try:  # the NCCL torch was built with (no CUDA context needed)
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - a summary line, not a check
            facts["nccl"] = f"unknown ({type(err).__name__})"
        facts["gpus"] = _gpu_lines() or SEEN.get("device_names") or []
        facts["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    else:
        from multigpu.records import cpu_name

        facts["cpu"] = cpu_name()
    return facts


def _render(facts: dict, total_s: float) -> str:
    lines = [f"## make gpu-check: {facts['machine']}", ""]
    if DEVICE == "cuda":
        lines.append(f"- torch {facts['torch']}, CUDA {facts['cuda']}, NCCL {facts['nccl']}, Python {facts['python']}, "
                     f"{facts['cpu_count']} CPU cores, commit {facts['git_commit']}"
                     + (f", CUDA_VISIBLE_DEVICES={facts['cuda_visible_devices']}"
                        if facts["cuda_visible_devices"] is not None else ""))
        lines += [f"- GPU {g}" for g in facts["gpus"]] or ["- GPU names: unknown (no nvidia-smi, no CUDA run finished)"]
    else:
        lines.append(f"- {facts['cpu']}, {facts['cpu_count']} cores; torch {facts['torch']}, Python {facts['python']}, "
                     f"commit {facts['git_commit']}")
    lines += ["", "| check | ranks | device | result | detail | s |", "| --- | --- | --- | --- | --- | --- |"]
    for r in ROWS:
        detail = str(r["detail"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['check']} | {r['world_size'] or ''} | {r['device'] or ''} | {r['result']} | {detail} "
                     f"| {r['seconds']} |")
    counts = {k: sum(r["result"] == k for r in ROWS) for k in ("passed", "FAILED", "ERROR", "skipped")}
    lines += ["", ", ".join(f"{n} {k}" for k, n in counts.items() if n) + f" in {total_s:.0f} s"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    """Print the summary after the last test (past pytest's capture) and write it to
    _build/gpu-check/."""
    start = time.monotonic()
    yield
    facts = _header()
    text = _render(facts, time.monotonic() - start)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.md").write_text(text)
    (OUT / "summary.json").write_text(json.dumps({**facts, "checks": ROWS}, indent=1) + "\n")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n\n" + text + f"(written to {OUT / 'summary.md'} and summary.json)")


@pytest.fixture(autouse=True)
def device_env(cpu_unless_asked, monkeypatch):
    """On GPUs, drop the test suite's CPU pin (conftest): `device="auto"` in the chapters' kernels
    must reach the GPUs, as it does for a reader. The self-check keeps it: auto is the CPU there."""
    if DEVICE == "cuda":
        monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setenv("MULTIGPU_PROGRESS", "0")


# -- one device ------------------------------------------------------------------------------

TINY = dict(model="gpt-tiny", global_batch_size=8, optimizer="sgd-momentum", lr=0.05, dataset="synthetic")


def test_single_device():
    """One process on one GPU: trains (the loss falls), and the record says where it ran and
    what the allocator held."""
    with recorded("single", world_size=1, device=DEVICE) as row:
        record = launch(RunConfig(strategy="single", steps=STEPS, device=DEVICE, **TINY), progress=False)
        _note(record)
        loss, prov = record["loss"], record["provenance"]
        row["detail"] = f"loss {loss[0]:.4f} -> {loss[-1]:.4f}, {prov['backend']}"
        assert prov["device_type"] == DEVICE and len(loss) == STEPS
        assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0], loss
        peak = record["cuda_allocator_peak_bytes_by_rank"][0]
        if DEVICE == "cuda":
            row["detail"] += f", allocator peak {peak / 2**20:.1f} MiB on {prov['device_names'][0]}"
            assert peak and peak > 0
        else:
            assert peak is None  # the CPU has no caching allocator to read


def test_a_profiled_step_on_the_device(tmp_path):
    """One device's step under torch's profiler (multigpu.profiling): on a GPU its kernels' time, the products'
    among them, and a timeline of kernels; the MFU against this device's matmul peak, measured here at one size."""
    from multigpu.estimator.flops import utilization
    from multigpu.experiments.limits import matmul_rates

    with recorded("profile", world_size=1, device=DEVICE) as row:
        cfg = RunConfig(strategy="single", steps=4, device=DEVICE, **{**TINY, "model": "gpt-mini"},
                        extra={"profile": str(tmp_path)})
        record = launch(cfg, progress=False)
        profile = record["profile_by_rank"][0]
        seconds, timeline = profile["seconds"], profile["timeline"]
        use = utilization(record, matmul_rates(DEVICE, "fp32", None, (1024, 2048), min_time_s=0.1))
        row["detail"] = (f"matmul {seconds['matmul'] * 1e3:.2f} ms of a {seconds['step'] * 1e3:.1f} ms step, "
                         f"{len(timeline['compute'])} compute spans, MFU {use['mfu']:.2%}")
        assert seconds["matmul"] > 0 and timeline["compute"] and timeline["communication"] == []
        counted = sum(seconds[k] for k in CATEGORIES if k != "outside operators")
        assert counted <= seconds["step"] * 1.05, f"categories {counted:.4f} s of a {seconds['step']:.4f} s step"
        assert 0 < use["mfu"] < 1 and (tmp_path / "rank0.json.gz").exists()


# -- every strategy family against one device ------------------------------------------------

SP = {"extra": {"sequence_parallel": True}}


@dataclass(frozen=True)
class Case:
    """A parity check: `sizes` are (world size, overrides) it can run at, smallest first; the
    largest that fits the machine is run."""

    name: str
    strategy: str
    sizes: tuple
    tolerance: float = TOLERANCE
    common: dict = field(default_factory=dict)  # overrides at every size
    cuda_only: str | None = None  # why it cannot run in the CPU self-check, if it cannot


def _pipeline(name: str) -> Case:  # as many micro-batches as stages and at least 4; gpt-mini has 4 blocks
    return Case(name, name, ((2, dict(grad_accum_steps=4)), (4, dict(grad_accum_steps=4, model="gpt-mini"))))


DATA_PARALLEL = ((2, {}), (4, {}), (8, {}))
CASES = [
    Case("tp", "tp", ((2, {}), (4, {}))),  # gpt-tiny's 4 heads: tp up to 4
    Case("tp-scratch (sequence parallel)", "tp-scratch", ((2, SP), (4, SP))),
    _pipeline("pp-1f1b-scratch"),
    _pipeline("pp-1f1b"),
    Case("fsdp", "fsdp", DATA_PARALLEL),
    Case("zero3", "zero3", DATA_PARALLEL),
    Case("deepspeed-zero2", "deepspeed-zero2", DATA_PARALLEL),
    # DeepSpeed's own autocast with fp32 weights (review F2: set blind, never run on a GPU)
    Case("deepspeed-zero2 bf16-mixed", "deepspeed-zero2", DATA_PARALLEL, BF16_TOLERANCE, dict(dtype="bf16-mixed")),
    Case("ddp-scratch x tp 2 (2D from scratch)", "ddp-scratch", ((2, dict(tp=2, **SP)), (4, dict(tp=2, **SP)))),
    Case("fsdp x tp 2 (2D)", "fsdp", ((4, dict(tp=2)), (8, dict(tp=2)))),
    Case("pp-1f1b x tp 2 (PP x TP)", "pp-1f1b", ((4, dict(tp=2, grad_accum_steps=2)),)),
    Case("pp-1f1b x fsdp 2 x tp 2 (3D)", "pp-1f1b", ((8, dict(tp=2, dp=2, grad_accum_steps=2)),)),
    # context parallelism: gpt-tiny's 64 tokens cut into 2 x cp zig-zag chunks; PyTorch's runs on one GPU too
    # (a ring of one: its context, its in-place cut of the batch and its kernels, nothing sent)
    Case("cp-scratch", "cp-scratch", ((2, {}), (4, {}))),
    Case("fsdp x cp 2", "fsdp", ((4, dict(cp=2)), (8, dict(cp=2)))),
    Case("cp (PyTorch's context_parallel)", "cp", ((1, {}), (2, {}), (4, {})),
         cuda_only="PyTorch's context_parallel replaces CUDA attention kernels only"),
    # expert parallelism: counts and tokens by all_to_all_single over NCCL (on one GPU an ep group of one: the
    # routing, the capacity and the all-to-alls' device tensors, nothing sent); capacity binds, tokens dropped
    Case("ep-scratch", "ep-scratch", ((1, {}), (2, {}), (4, {})),
         common=dict(model="gpt-moe-tiny", extra={"moe_capacity_factor": 1.0})),
    Case("ep-scratch bf16-mixed", "ep-scratch", ((1, {}), (2, {}), (4, {})), BF16_TOLERANCE,
         dict(model="gpt-moe-tiny", dtype="bf16-mixed")),
    Case("fsdp x ep", "fsdp", ((2, dict(ep=2)), (4, dict(ep=2)), (8, dict(ep=4))), common=dict(model="gpt-moe-tiny")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name.split(" (")[0].replace(" ", "") for c in CASES])
def test_matches_one_device(case):
    """Two steps on min(G, what the strategy takes) ranks == two steps of one device on the
    whole batch: weights and losses within the tolerance (1e-5 in fp32, 1e-3 under bf16
    autocast), and the reference really trained."""
    with recorded(case.name, device=DEVICE) as row:
        if case.cuda_only and DEVICE != "cuda":
            pytest.skip(f"{case.name}: {case.cuda_only}; the CPU self-check cannot run it")
        fitting = [(n, o) for n, o in case.sizes if n <= GPUS]
        if not fitting:
            _needs(case.sizes[0][0], case.name)
        world, overrides = fitting[-1]
        row["world_size"] = world
        result = check(case.strategy, world, steps=STEPS, tolerance=case.tolerance, device=DEVICE, progress=False,
                       **TINY | case.common | overrides)
        row.update(max_abs_param_diff=result["max_abs_param_diff"], max_abs_loss_diff=result["max_abs_loss_diff"],
                   tolerance=case.tolerance, loss=result["loss"], reference_loss=result["reference_loss"])
        row["detail"] = (f"param {result['max_abs_param_diff']:.1e}, loss {result['max_abs_loss_diff']:.1e} "
                         f"(tolerance {case.tolerance:.0e})")
        if not result["passed"]:
            row["result"] = "FAILED"
        assert result["passed"], result
        assert len(result["loss"]) == STEPS and result["reference_loss"][-1] < result["reference_loss"][0], result


# -- checkpoints on the device ---------------------------------------------------------------


@pytest.mark.parametrize("strategy, n, background", [("single", 1, False), ("single", 1, True), ("fsdp", 1, True),
                                                     ("fsdp", 2, True), ("fsdp", 4, False)])
def test_resume_is_exact(strategy, n, background, tmp_path):
    """Three steps saving after the second (blocking, or staged to host memory and written in the background),
    then again from that checkpoint: the same weights bit for bit (CUDA's generators are in the checkpoint)."""
    _needs(n, f"{strategy} resumed")
    with recorded(f"resume {strategy}{' async' if background else ''}", world_size=n, device=DEVICE) as row:
        base = RunConfig(strategy=strategy, world_size=n, steps=3, device=DEVICE, dataset_size=24,
                         **{**TINY, "optimizer": "adamw", "lr": 0.01})
        unbroken = launch(base.replace(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2,
                                       checkpoint_async=background), params_path=tmp_path / "a.pt", progress=False)
        _note(unbroken)
        resumed = launch(base.replace(resume=str(tmp_path / "ck" / "step-00000002")), params_path=tmp_path / "b.pt",
                         progress=False)
        a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        save = unbroken["checkpoint"]["saves"][0][0]
        row["detail"] = (f"{save['bytes_total'] / 2**20:.2f} MiB written, blocked {save['blocking_s'] * 1e3:.0f} of "
                         f"{save['total_s'] * 1e3:.0f} ms; {len(differ)} tensors differ")
        assert resumed["loss"] == unbroken["loss"] and not differ, differ


# -- the estimator against the CUDA allocator ------------------------------------------------

@pytest.mark.parametrize("strategy", ["single", "ddp", "zero2", "fsdp", "ep-scratch"])
def test_estimate_agrees_with_the_cuda_allocator(strategy):
    """tests/test_estimate.py's GPU test, also on one GPU (single; ep-scratch: a mixture of experts,
    ep 1): the estimated peak of rank 0 within 10% of what the caching allocator held at its peak
    (cuBLAS's workspaces and the allocator's rounding included)."""
    world = 1 if strategy in ("single", "ep-scratch") else 2
    with recorded(f"estimate vs CUDA allocator: {strategy}", world_size=world, device=DEVICE) as row:
        _needs(world, f"the estimate for {strategy}")
        from multigpu.estimator.accuracy import setup_of
        from multigpu.estimator.peak import estimate

        model = "gpt-moe-small" if strategy == "ep-scratch" else "gpt-small"
        record = launch(RunConfig(strategy=strategy, world_size=world, model=model, seq_len=128,
                                  global_batch_size=8, steps=3, optimizer="adamw", device=DEVICE), progress=False)
        _note(record)
        estimated = estimate(setup_of(record), 8).per_rank_bytes["total"]
        measured = record["cuda_allocator_peak_bytes_by_rank"][0]
        row.update(estimated_bytes=estimated, allocator_peak_bytes=measured)
        if DEVICE != "cuda":
            assert measured is None
            pytest.skip(f"the comparison needs the CUDA caching allocator, which the CPU self-check has not "
                        f"(launched, estimated {estimated / 2**20:.1f} MiB for rank 0)")
        error = estimated / measured - 1
        row["detail"] = (f"estimate {estimated / 2**20:.1f} MiB, allocator {measured / 2**20:.1f} MiB "
                         f"({error:+.1%}, tolerance {ALLOCATOR_TOLERANCE:.0%})")
        if abs(error) > ALLOCATOR_TOLERANCE:
            row["result"] = "FAILED"
        assert abs(error) <= ALLOCATOR_TOLERANCE, (estimated, measured)


# -- the chapters' live cells ----------------------------------------------------------------

# appended to each chapter: what its live cells ran on, and what they found
FACTS = {
    "one_device": """{"device": record["provenance"]["device_type"], "model": model, "loss": record["loss"]}""",
    "pp": """{"device": results[0]["device"],
              "checks": [{k: r[k] for k in ("strategy", "max_abs_param_diff", "max_abs_loss_diff", "passed")}
                         for r in results]}""",
    "together": """{"device": by_node[0]["provenance"]["device_type"],
                    "nodes_device": [by_node[n]["provenance"]["device_type"] for n in range(n_nodes)],
                    "reference_device": reference["provenance"]["device_type"],
                    "loss_diff": float(two_nodes.drop(columns="single device").sub(two_nodes["single device"],
                                       axis=0).abs().max().max())}""",
}
# GPUs a chapter's live cells need to be worth running here, and to run on the GPUs: below the
# second number `device="auto"` falls back to the CPU (the device plan), which is checked too
CHAPTERS = {"one_device": (1, 1), "pp": (2, 2), "together": (2, 4)}  # together: 2 stand-in nodes x 2 processes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_chapter_executes(chapter, tmp_path, monkeypatch):
    """The whole chapter in a notebook kernel, as `make book` executes it, reading a copy of
    results/: no cell fails, and its live runs ran where the device plan says (the GPUs when
    there is one for every process)."""
    least, on_gpus = CHAPTERS[chapter]
    expected = DEVICE if GPUS >= on_gpus else "cpu"
    with recorded(f"book/{chapter}.md live cells", world_size=None, device=expected) as row:
        _needs(least, f"book/{chapter}.md's live runs")
        import jupytext
        import nbformat
        from nbclient import NotebookClient

        shutil.copytree(ROOT / "results", tmp_path / "results")
        monkeypatch.setenv("MULTIGPU_RESULTS", str(tmp_path / "results"))
        nb = jupytext.read(ROOT / "book" / f"{chapter}.md")
        nb.cells.append(nbformat.v4.new_code_cell(
            "import json as _json\nfrom multigpu.config import RunConfig\nfrom multigpu.runtime import device_plan\n"
            f"print('@@facts', _json.dumps({FACTS[chapter]}))"))
        NotebookClient(nb, timeout=540, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT / "book")}}).execute()
        text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
        facts = json.loads(text.split("@@facts", 1)[1])
        row["facts"] = facts
        row["detail"] = f"ran on {facts['device']}"
        if chapter == "pp":
            row["detail"] += "; " + ", ".join(f"{c['strategy']} param {c['max_abs_param_diff']:.1e} loss "
                                              f"{c['max_abs_loss_diff']:.1e}" for c in facts["checks"])
            assert all(c["passed"] for c in facts["checks"]), facts
        elif chapter == "together":
            row["detail"] += (f" (reference on {facts['reference_device']}); loss {facts['loss_diff']:.1e} "
                              "from one device's")
            assert set(facts["nodes_device"]) == {expected}, facts
            assert facts["loss_diff"] <= 1e-4, facts  # the reference may run on a GPU, the nodes on the CPU
        else:
            row["detail"] += f"; {facts['model']}, loss {facts['loss'][0]:.3f} -> {facts['loss'][-1]:.3f}"
        assert facts["device"] == expected, facts
