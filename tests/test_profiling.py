"""A run's last step under torch's profiler (multigpu.profiling): its time by category, each rank's trace for
Perfetto, and the steps the record times left untouched by it."""

from __future__ import annotations

import gzip
import json

import pytest

from multigpu.config import RunConfig
from multigpu.errors import ConfigError
from multigpu.launch import launch
from multigpu.profiling import CATEGORIES, breakdown, category, merged, overlap, timeline, without


def test_operators_fall_into_the_categories():
    assert category("aten::addmm", None) == "matmul" and category("aten::bmm", "optimizer") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu", None) == "attention"
    assert category("c10d::allreduce_", None) == category("_c10d_functional::wait_tensor", None) == "communication"
    assert category("aten::copy_", "communication") == "communication"  # FSDP's copies into its gathers
    assert category("aten::mul_", "optimizer") == "optimizer" and category("aten::gelu", None) == "other operators"


class _Event:
    """What the profiler's FunctionEvent answers, for one operator, kernel or labelled range (times in µs)."""

    def __init__(self, name, on, start, end, own, parent=None, annotation=False):
        from types import SimpleNamespace

        from torch.autograd import DeviceType

        self.name, self.cpu_parent, self.is_user_annotation = name, parent, annotation
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
