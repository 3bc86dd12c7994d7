"""A run's last step under torch's profiler (multigpu.profiling): its time by category, each rank's trace for
Perfetto, and the steps the record times left untouched by it."""

from __future__ import annotations

import gzip
import json

import pytest

from multigpu.config import RunConfig
from multigpu.errors import ConfigError
from multigpu.launch import launch
from multigpu.profiling import CATEGORIES, breakdown, category, idle, merged, overlap, timeline, without


def test_operators_fall_into_the_categories():
    assert category("aten::addmm", None) == "matmul" and category("aten::bmm", "optimizer") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu", None) == "attention"
    assert category("c10d::allreduce_", None) == category("_c10d_functional::wait_tensor", None) == "communication"
    assert category("aten::copy_", "communication") == "communication"  # FSDP's copies into its gathers
    assert category("aten::mul_", "optimizer") == "optimizer" and category("aten::gelu", None) == "other operators"


class _Event:
    """What the profiler's FunctionEvent answers, for one operator, kernel or labelled range (times in µs)."""

    def __init__(self, name, on, start, end, own, parent=None, annotation=False, launcher=None):
        from types import SimpleNamespace

        from torch.autograd import DeviceType

        self.name, self.cpu_parent, self.is_user_annotation = name, parent, annotation
        self.id = id(self)  # a kernel links to the operator that launched it (its correlation id)
        self.linked_correlation_id = launcher.id if launcher is not None else 0
        self.device_type = DeviceType.CUDA if on == "cuda" else DeviceType.CPU
        self.time_range = SimpleNamespace(start=start, end=end)
        self.self_device_time_total = own if on == "cuda" else 0
        self.self_cpu_time_total = own if on == "cpu" else 0


def test_a_gpu_profile_counts_each_kernel_once():
    """On a GPU the profiler lists an operator (with its kernels' device time), the kernel itself, and a labelled
    range's copy on the device: the step's kernels take 300 µs, and the categories must add up to that, not twice
    it (the H200's first profiles counted every kernel again under "other operators")."""
    class Prof:
        def __init__(self, events):
            self._events = events

        def events(self):
            return self._events

    step = _Event("Optimizer.step#AdamW.step", "cpu", 250, 400, 0, annotation=True)
    mm = _Event("aten::mm", "cpu", 0, 50, 0)
    mm.self_device_time_total = 200
    adam = _Event("aten::_foreach_mul_", "cpu", 260, 270, 0, parent=step)
    adam.self_device_time_total = 100
    events = [mm, _Event("sm90_xmma_gemm", "cuda", 10, 210, 200), step, adam,
              _Event("multi_tensor_apply_kernel", "cuda", 300, 400, 100),
              _Event("Optimizer.step#AdamW.step", "cuda", 300, 400, 100, annotation=True)]
    seconds = breakdown(Prof(events), "cuda", wall_s=500e-6)
    assert seconds["matmul"] == pytest.approx(200e-6) and seconds["optimizer"] == pytest.approx(100e-6)
    assert seconds["other operators"] == 0 and seconds["outside operators"] == pytest.approx(200e-6)
    spans = timeline(Prof(events), "cuda", wall_s=500e-6)["compute"]  # the kernels, not the labelled range
    assert [t for span in spans for t in span] == pytest.approx([0.0, 200e-6, 290e-6, 390e-6])


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_a_gpu_pipelines_bubble_is_idle_time_not_outside_operators():
    """On NCCL a stage's receive kernel starts when its stream reaches it and spins until the neighbour's activation
    arrives: the bubble (1-3 ms of a 4 ms step) is kernel time under "communication", the device is never without a
    kernel, and what says the bubble is the time the rank computed nothing."""
    fwd, bwd = _Event("aten::mm", "cpu", 0, 50, 0), _Event("aten::mm", "cpu", 60, 70, 0)
    fwd.self_device_time_total = bwd.self_device_time_total = 1000
    recv = _Event("nccl:coalesced", "cpu", 55, 58, 0)
    recv.self_device_time_total = 2000
    events = [fwd, _Event("sm90_xmma_gemm", "cuda", 0, 1000, 1000, launcher=fwd), recv,
              _Event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "cuda", 1000, 3000, 2000,
                     launcher=recv),
              bwd, _Event("sm90_xmma_gemm", "cuda", 3000, 4000, 1000, launcher=bwd)]
    seconds = breakdown(_Prof(events), "cuda", wall_s=4e-3)
    assert seconds["communication"] == pytest.approx(2e-3) and seconds["outside operators"] == 0
    line = timeline(_Prof(events), "cuda", wall_s=4e-3)
    assert line["compute"] == [pytest.approx([0, 1e-3]), pytest.approx([3e-3, 4e-3])]
    assert idle({"seconds": seconds, "timeline": line}) == pytest.approx(2e-3)


def test_gpu_kernels_overlapping_on_two_streams_leave_no_time_outside_operators():
    """A DDP bucket's all-reduce kernel (1-4 ms) beside backward's products (0-4 ms): the categories add up to more
    than the 5 ms step, and the time outside operators is the 1 ms in which no kernel ran, not the 0 that the step
    less their sum (clipped) gave."""
    mm, reduce = _Event("aten::mm", "cpu", 0, 50, 0), _Event("c10d::allreduce_", "cpu", 60, 70, 0)
    mm.self_device_time_total, reduce.self_device_time_total = 4000, 3000
    events = [mm, _Event("sm90_xmma_gemm", "cuda", 0, 4000, 4000, launcher=mm), reduce,
              _Event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "cuda", 1000, 4000, 3000, launcher=reduce)]
    seconds = breakdown(_Prof(events), "cuda", wall_s=5e-3)
    assert seconds["matmul"] + seconds["communication"] > 5e-3
    assert seconds["outside operators"] == pytest.approx(1e-3)
    assert timeline(_Prof(events), "cuda", wall_s=5e-3)["hidden"] == pytest.approx(1.0)


def test_fsdps_copies_into_its_gathers_are_not_compute_on_a_gpu():
    """FSDP's copy-in kernel, launched by an operator inside its all-gather range, is the gather's cost on a GPU as
    on a CPU (`_in_collective`, `_under`): not in the compute timeline."""
    gather = _Event("FSDP::all_gather_copy_in", "cpu", 0, 20, 0, annotation=True)
    copy = _Event("aten::copy_", "cpu", 5, 10, 0, parent=gather)
    copy.self_device_time_total = 500
    mm = _Event("aten::mm", "cpu", 30, 40, 0)
    mm.self_device_time_total = 1000
    events = [gather, copy, _Event("elementwise_kernel", "cuda", 0, 500, 500, launcher=copy), mm,
              _Event("sm90_xmma_gemm", "cuda", 1000, 2000, 1000, launcher=mm)]
    assert breakdown(_Prof(events), "cuda", wall_s=2e-3)["communication"] == pytest.approx(500e-6)
    assert timeline(_Prof(events), "cuda", wall_s=2e-3)["compute"] == [pytest.approx([0, 1e-3])]  # the product


@pytest.mark.slow
def test_a_profiled_run_times_the_other_steps_and_writes_each_ranks_trace(tmp_path):
    cfg = RunConfig(strategy="ddp", world_size=2, model="gpt-tiny", steps=5, global_batch_size=4, seq_len=16,
                    threads_per_worker=1, extra={"profile": str(tmp_path / "traces")})
    record = launch(cfg, progress=False)
    profiles = record["profile_by_rank"]
    assert len(profiles) == 2
    for rank, profile in enumerate(profiles):
        seconds = profile["seconds"]
        assert set(seconds) == {*CATEGORIES, "step", "largest"}
        assert seconds["matmul"] > 0 and seconds["communication"] > 0 and seconds["optimizer"] > 0
        assert seconds["step"] == record["step_times_s_by_rank"][rank][-1]  # the last step, profiled
        timeline = profile["timeline"]
        assert timeline["compute"] and timeline["communication"] and 0 <= timeline["hidden"] <= 1
        assert all(a < b for row in ("compute", "communication") for a, b in timeline[row])
        assert timeline["communication"][-1][1] <= seconds["step"] * 1.01  # inside the step (a profiler's rounding)
        with gzip.open(profile["trace"]) as f:
            assert any(e.get("name") == "aten::addmm" for e in json.load(f)["traceEvents"])
    # steps 0-2 are tracked and counted, step 4 profiled: step 3 alone is timed
    assert record["timed_steps"] == 1 and record["step_time_s"] == max(t[3] for t in record["step_times_s_by_rank"])


def test_the_profile_option_is_true_or_a_folder():
    RunConfig(model="gpt-tiny", extra={"profile": True}).validate()
    with pytest.raises(ConfigError, match="profile must be true"):
        RunConfig(model="gpt-tiny", extra={"profile": 3}).validate()


def test_intervals_are_merged_cut_and_intersected():
    assert merged([(3, 4), (0, 1), (1.05, 2)], gap=0.1) == [[0, 2], [3, 4]]
    assert merged([(0, 1), (1.5, 2)]) == [[0, 1], [1.5, 2]]
    assert without([[0, 10], [12, 13]], [[2, 3], [5, 6], [12.5, 14]]) == [[0, 2], [3, 5], [6, 10], [12, 12.5]]
    assert overlap([[0, 2], [3, 5]], [[1, 4]]) == 2
    assert overlap([[0, 1]], [[1, 2]]) == 0
