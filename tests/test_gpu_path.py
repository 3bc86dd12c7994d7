"""The GPU path, where it can be tested without a GPU (review gpu-path-2: G4, G7, G9, G10, G11).

No test here needs CUDA: each either reads a record as a CUDA machine writes it, or replaces
the few torch.cuda calls the code under test makes with fakes that keep what was asked of
them, so the CUDA branch runs on this CPU and its bookkeeping is checked.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from multigpu import records
from multigpu.config import RunConfig
from multigpu.estimator.accuracy import against_records, setup_of
from multigpu.estimator.peak import estimate
from multigpu.estimator.question import cublas_workspace_bytes
from multigpu.memory import CATEGORIES, ProcessPeaks
from multigpu.models import GPT, GPT_SIZES
from multigpu.strategies import pp, pp_scratch
from multigpu.strategies.pp_scratch import ActionClock, Pipeline
from multigpu.strategies.pp_split import stage_blocks

MiB = 2**20
H100 = "NVIDIA H100 80GB HBM3"


def _cuda_record(**provenance) -> dict:
    """A ddp run as a 2-GPU NCCL machine records it, tracker categories included."""
    cfg = RunConfig(strategy="ddp", world_size=2, model="gpt-tiny", seq_len=64, global_batch_size=4, steps=3)
    peak = dict.fromkeys(CATEGORIES, 1 * MiB) | {"total": 5 * MiB}
    return {"config": cfg.to_dict(), "peak_memory_bytes_by_rank": [peak, peak],
            "saved_activation_bytes_by_rank": [MiB, MiB],
            "provenance": {"backend": "nccl", "device_type": "cuda", "device_names": [H100, H100], **provenance}}


# -- G4: the estimate held against the tracker has no cuBLAS workspaces, against the allocator it has

def test_the_tracker_is_held_against_no_workspaces_the_allocator_against_two():
    record = _cuda_record()
    tracker, allocator = setup_of(record, against="tracker"), setup_of(record, against="allocator")
    assert tracker.on_cuda and allocator.on_cuda  # both keep the allocator's 512-byte rounding
    assert tracker.cuda_workspace_bytes == 0
    assert allocator.cuda_workspace_bytes == 2 * 32 * MiB  # an H100: two 32 MiB workspaces
    assert setup_of(record) == allocator  # the default: what fits.memory_problem asks (the GPU's memory)
    held = {s: estimate(s, 4).per_rank_bytes for s in (tracker, allocator)}
    assert held[allocator]["other"] - held[tracker]["other"] == 64 * MiB
    assert held[allocator]["total"] - held[tracker]["total"] == 64 * MiB
    with pytest.raises(ValueError, match="against"):
        setup_of(record, against="resident set")


def test_against_records_compares_the_tracker_without_workspaces():
    record = _cuda_record()
    [row] = against_records([record])
    assert row["estimated"] == estimate(setup_of(record, against="tracker"), 4).per_rank_bytes


def test_a_cpu_record_has_no_workspaces_either_way():
    record = _cuda_record()
    record["provenance"] = {"backend": "gloo", "device_type": "cpu", "device_names": ["AMD EPYC 7B13"]}
    assert {setup_of(record, against=a).cuda_workspace_bytes for a in ("tracker", "allocator")} == {0}


# -- G10: the workspace size from torch itself, else the compute capability, else the name

@pytest.mark.parametrize(("capability", "mib"), [((7, 0), 8.125), ((8, 0), 8.125), ((8, 9), 8.125), ((9, 0), 32),
                                                 ((10, 0), 32), ((10, 3), 32), ((11, 0), 32), ((12, 0), 32)])
def test_the_workspace_follows_the_compute_capability(capability, mib):
    # the capability decides, whatever the name says
    assert cublas_workspace_bytes("some GPU", capability) == 2 * mib * MiB
    assert cublas_workspace_bytes(H100, capability) == 2 * mib * MiB


def test_the_name_rule_is_the_fallback_and_torchs_size_comes_first():
    assert cublas_workspace_bytes(H100) == 64 * MiB
    assert cublas_workspace_bytes("NVIDIA GB300") == 64 * MiB
    assert cublas_workspace_bytes("NVIDIA A100-SXM4-80GB") == 2 * (8 * MiB + 128 * 2**10)
    assert cublas_workspace_bytes(None) == 0
    # CUBLAS_WORKSPACE_CONFIG=:4096:2 on an H100: torch's own answer wins over capability and name
    assert cublas_workspace_bytes(H100, (9, 0), workspace_size=8 * MiB) == 16 * MiB


def test_setup_of_uses_what_the_record_kept():
    rtx = "NVIDIA GeForce RTX 5090"  # sm 12.0: 32 MiB, which its name alone would not tell
    assert setup_of(_cuda_record(device_names=[rtx])).cuda_workspace_bytes == 2 * (8 * MiB + 128 * 2**10)
    assert setup_of(_cuda_record(device_names=[rtx], compute_capability=[12, 0])).cuda_workspace_bytes == 64 * MiB
    kept = _cuda_record(compute_capability=[9, 0], cublas_workspace_size_bytes=4 * MiB)
    assert setup_of(kept).cuda_workspace_bytes == 8 * MiB
    assert setup_of(kept, against="tracker").cuda_workspace_bytes == 0


def _fake_gpus(monkeypatch, workspace: int | None = 32 * MiB):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    if workspace is None:  # a torch before 2.13
        monkeypatch.delattr(torch.backends.cuda, "cublas_workspace_size")
    else:
        monkeypatch.setattr(torch.backends.cuda, "cublas_workspace_size", lambda size=None: workspace)


def test_provenance_records_the_workspace_and_capability_on_cuda_only(monkeypatch):
    cpu = records.provenance("gloo", 2, "cpu", 1)
    assert "compute_capability" not in cpu and "cublas_workspace_size_bytes" not in cpu
    _fake_gpus(monkeypatch)
    gpu = records.provenance("nccl", 2, "cuda", 1)
    assert gpu["compute_capability"] == [9, 0] and gpu["cublas_workspace_size_bytes"] == 32 * MiB
    record = _cuda_record(**{k: gpu[k] for k in ("compute_capability", "cublas_workspace_size_bytes")})
    assert setup_of(record).cuda_workspace_bytes == 64 * MiB


def test_provenance_without_torchs_workspace_query_keeps_the_capability(monkeypatch):
    _fake_gpus(monkeypatch, workspace=None)
    gpu = records.provenance("nccl", 2, "cuda", 1)
    assert gpu["compute_capability"] == [9, 0] and "cublas_workspace_size_bytes" not in gpu


# -- G7: the pipelines' event logs on the device's clock, the loss read once per step

class _FakeEvent:
    """torch.cuda.Event as the clock uses it: recorded at a fake GPU time, read only after
    synchronize (elapsed_time on an unfinished event raises on CUDA too)."""

    gpu_ms = 0.0
    synchronized: list[_FakeEvent] = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = self.done = None

    def record(self, stream=None):
        self.at = _FakeEvent.gpu_ms

    def synchronize(self):
        self.done = True
        _FakeEvent.synchronized.append(self)

    def elapsed_time(self, end):
        assert self.done and end.done, "an event read before it was waited for"
        return end.at - self.at


def test_on_cuda_the_clock_reads_events_after_the_step(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "synchronized", [])
    clock = ActionClock(torch.device("cuda", 0))
    assert clock.clock == "cuda-events"
    _FakeEvent.gpu_ms = 100.0
    clock.start_step()
    _FakeEvent.gpu_ms = 102.0
    start = clock.now()
    _FakeEvent.gpu_ms = 105.5
    clock.log(start, stage=1, action="F", micro=0)
    start = clock.now()
    _FakeEvent.gpu_ms = 107.0
    clock.log(start, stage=1, action="send_forward", micro=0)
    assert _FakeEvent.synchronized == []  # nothing inside the step waits for the GPU
    assert clock.events == [{"stage": 1, "action": "F", "micro": 0, "start_s": 0.002, "end_s": 0.0055},
                            {"stage": 1, "action": "send_forward", "micro": 0, "start_s": 0.0055, "end_s": 0.007}]
    clock.start_step()  # a new step forgets the last one's log
    assert clock.events == []


def test_on_a_cpu_the_clock_is_the_hosts():
    clock = ActionClock(torch.device("cpu"))
    assert clock.clock == "host" and clock.events == []
    clock.start_step()
    start = clock.now()
    clock.log(start, stage=0, action="B", micro=3)
    [event] = clock.events
    assert event["action"] == "B" and event["micro"] == 3 and 0 <= event["start_s"] <= event["end_s"] < 1
    assert clock.start_unix is not None


def _tiny(n_layer=4) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(GPT_SIZES["gpt-tiny"], n_layer=n_layer))


def test_one_stage_pipeline_reads_no_loss_inside_the_step(monkeypatch):
    """The last stage sums the micro-batches' losses on the device (float64, in order, as the
    shared loop does) and hands back a tensor: nothing calls .item() during the step."""
    model = _tiny(2)
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 128, (2, 16), generator=gen),
                "labels": torch.randint(0, 128, (2, 16), generator=gen)} for _ in range(3)]
    expected = 0.0  # Python's float sum of each micro-batch's loss/m, as the pipeline summed before
    for b in batches:
        expected += (model(**b) / 3).item()
    pipe = Pipeline(model, None, 0, 1, pp_scratch.gpipe)
    items = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: items.append(t) or real_item(t))
    loss = pipe.run(batches)
    assert items == []
    monkeypatch.undo()
    assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float64 and loss.item() == expected
    assert pipe.clock == "host" and [(e["action"], e["micro"]) for e in pipe.events] == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_the_library_pipelines_log_through_the_same_clock():
    calls = []

    class Stage:  # the three per-chunk methods log_actions wraps
        stage_index = 3

        def forward_one_chunk(self, chunk, *args):
            calls.append(("forward", chunk))

        def backward_one_chunk(self, chunk, **kwargs):
            calls.append(("backward", chunk))

        def backward_weight_one_chunk(self, chunk):
            calls.append(("weight", chunk))

    stage, clock = Stage(), ActionClock(torch.device("cpu"))
    pp.log_actions(stage, clock)
    clock.start_step()
    stage.forward_one_chunk(0, "x")
    stage.backward_one_chunk(0, loss=None)
    stage.backward_weight_one_chunk(0)
    assert calls == [("forward", 0), ("backward", 0), ("weight", 0)]
    assert [(e["stage"], e["action"], e["micro"]) for e in clock.events] == [(3, "F", 0), (3, "B", 0), (3, "W", 0)]


def test_a_timeline_claims_gpu_time_only_for_cuda_events():
    from multigpu.plots.model_parallel import _timeline_clock

    def run(device_type, *clocks):
        return {"provenance": {"device_type": device_type},
                "strategy_report_by_rank": [{"clock": c} for c in clocks]}

    assert _timeline_clock([run("cpu", "host", "host")]) == ""
    assert _timeline_clock([{"provenance": {"device_type": "cpu"}}]) == ""  # pp_bubble's records: no clock key
    assert "GPU time" in _timeline_clock([run("cuda", "cuda-events", "cuda-events")])
    assert "host clock" in _timeline_clock([run("cuda", "cuda-events", "host")])
    assert "host clock" in _timeline_clock([run("cuda", None)])  # written before the clock was recorded


# -- G9: a library pipeline's rank keeps no whole model

@pytest.mark.parametrize(("schedule", "rank", "p"), [("pp-1f1b", 1, 2), ("pp-interleaved", 0, 2), ("pp-zbv", 0, 2)])
def test_the_first_stage_is_the_model_cut_and_only_others_are_copies(schedule, rank, p):
    model = _tiny(4)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    kind = pp.SCHEDULES[schedule]
    stages = pp.build_stages(model, kind, rank, p, torch.device("cpu"))
    assert [s.index for s in stages] == pp.stage_indices(kind, rank, p)
    assert stages[0].piece is model  # cut in place: no uncut model left behind
    assert all(s.piece is not model for s in stages[1:])
    for s in stages:  # every piece holds the whole model's weights of its own blocks, and no others
        state = s.piece.state_dict()
        assert all(torch.equal(state[k], whole[k]) for k in state)
        assert set(s.piece.blocks) == {str(b) for b in stage_blocks(4, s.num_stages, s.index)}


# -- G11: dp on GPUs resets every replica's peak as a step begins

def _fake_allocator(monkeypatch, replicas: int):
    """Each device's allocated bytes and peak, as torch.cuda's allocator statistics keep them."""
    state = {torch.device("cuda", i): {"now": 0, "peak": 0} for i in range(replicas)}

    def of(device):
        return state[torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)]

    def allocate(device, nbytes):
        s = of(device)
        s["now"] += nbytes
        s["peak"] = max(s["peak"], s["now"])

    def reset(device):
        of(device)["peak"] = of(device)["now"]

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: of(device)["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: of(device)["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: of(device)["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    return allocate


def test_every_replica_starts_each_step_from_zero(monkeypatch):
    from multigpu.strategies.dp import GPUDataParallel

    allocate = _fake_allocator(monkeypatch, 2)
    # what nn.DataParallel asks of the GPUs when it is built (it checks they are balanced)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=80 * 2**30, multi_processor_count=132))
    module = GPUDataParallel(_tiny(2), 2)
    assert module.peak_devices == [torch.device("cuda", 0), torch.device("cuda", 1)]

    machine = ProcessPeaks(torch.device("cuda", 0))
    machine.reset_also(module.peak_devices)  # as train() does after prepare
    for primary, replica in [(300, 200), (50, 40)]:  # step 0 replicates the model: more
        machine.start_step()
        allocate(0, primary)
        allocate(1, replica)
        allocate(0, -primary)
        allocate(1, -replica)
        machine.end_step()
    peaks = [r["total"] for r in module.report(optimizer=None)["peak_memory_bytes_by_replica"]]
    assert peaks == [50, 40]  # both the last step's: replica 1 no longer carries step 0's peak
    assert machine.peak_by_step == [300, 50]


def test_a_process_with_one_device_resets_only_its_own(monkeypatch):
    _fake_allocator(monkeypatch, 2)
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset.append)
    machine = ProcessPeaks(torch.device("cuda", 1))
    machine.reset_also(())  # a strategy with no peak_devices (every other one)
    machine.start_step()
    assert reset == [torch.device("cuda", 1)]
    cpu = ProcessPeaks(torch.device("cpu"))
    cpu.reset_also([torch.device("cuda", 0)])  # a CPU process resets no GPU
    assert cpu.reset_devices == [torch.device("cpu")]
