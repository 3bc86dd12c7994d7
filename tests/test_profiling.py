"""A run's last step under torch's profiler (multigpu.profiling): its time by category, each rank's trace for
Perfetto, and the steps the record times left untouched by it."""

from __future__ import annotations

import gzip
import json

import pytest

from multigpu.config import RunConfig
from multigpu.errors import ConfigError
from multigpu.launch import launch
from multigpu.profiling import CATEGORIES, category


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
        with gzip.open(profile["trace"]) as f:
            assert any(e.get("name") == "aten::addmm" for e in json.load(f)["traceEvents"])
    # steps 0-2 are tracked and counted, step 4 profiled: step 3 alone is timed
    assert record["timed_steps"] == 1 and record["step_time_s"] == max(t[3] for t in record["step_times_s_by_rank"])


def test_the_profile_option_is_true_or_a_folder():
    RunConfig(model="gpt-tiny", extra={"profile": True}).validate()
    with pytest.raises(ConfigError, match="profile must be true"):
        RunConfig(model="gpt-tiny", extra={"profile": 3}).validate()
