"""A run's last step under torch's profiler (multigpu.profiling): its time by category, each rank's trace for
Perfetto, and the steps the record times left untouched by it."""

from __future__ import annotations

import gzip
import json

import pytest

from multigpu.config import RunConfig
from multigpu.errors import ConfigError
from multigpu.launch import launch
from multigpu.profiling import CATEGORIES, category, merged, overlap, without


def test_operators_fall_into_the_categories():
    assert category("aten::addmm", None) == "matmul" and category("aten::bmm", "optimizer") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu", None) == "attention"
    assert category("c10d::allreduce_", None) == category("_c10d_functional::wait_tensor", None) == "communication"
    assert category("aten::copy_", "communication") == "communication"  # FSDP's copies into its gathers
    assert category("aten::mul_", "optimizer") == "optimizer" and category("aten::gelu", None) == "other operators"


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
