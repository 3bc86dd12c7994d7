"""RunConfig.validate: a bad value is refused before any process starts, with a message
that names the value and says what to do. References: the lists of allowed values the
package publishes (config.STRATEGIES, models.PRESETS, ...) and arithmetic on the sizes."""

from __future__ import annotations

import json
import re

import pytest

from multigpu import config
from multigpu.config import DATASET_TOKENS, ConfigError, RunConfig, max_cpu_workers
from multigpu.models import PRESETS


def refused(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        RunConfig(**fields).validate()
    return str(info.value)


def test_defaults_are_valid():
    """The defaults describe a runnable config (so the refusals below are about the change)."""
    assert RunConfig().validate() == RunConfig()


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one(world_size):
    message = refused(strategy="ddp", world_size=world_size)
    assert f"world_size must be a whole number >= 1, got {world_size}" in message


def test_world_size_must_be_an_integer():
    assert "got '2'" in refused(strategy="ddp", world_size="2")


def test_world_size_beyond_the_machine():
    limit = max_cpu_workers()
    message = refused(strategy="ddp", world_size=limit + 1, global_batch_size=8 * (limit + 1))
    assert f"world_size={limit + 1}" in message
    assert f"limit {limit}" in message
    assert "use fewer processes" in message
    # the limit itself is allowed
    RunConfig(strategy="ddp", world_size=limit, global_batch_size=8 * limit).validate()


def test_global_batch_not_divisible():
    """The message's suggestion must itself be a valid global batch size."""
    message = refused(strategy="ddp", world_size=2, grad_accum_steps=2, global_batch_size=6)
    assert "global_batch_size=6" in message
    assert "world_size=2 x grad_accum_steps=2 = 4 micro-batches" in message
    assert "use a multiple of 4" in message
    suggested = int(re.search(r"e\.g\. (\d+)", message).group(1))
    assert suggested % 4 == 0
    RunConfig(strategy="ddp", world_size=2, grad_accum_steps=2, global_batch_size=suggested).validate()


@pytest.mark.parametrize(
    "field, label, allowed",
    [
        ("strategy", "strategy", list(config.STRATEGIES)),
        ("model", "model preset", list(PRESETS)),
        ("dtype", "dtype", list(config.DTYPES)),
        ("optimizer", "optimizer", list(config.OPTIMIZERS)),
        ("device", "device", list(config.DEVICES)),
        ("dataset", "dataset", list(config.DATASETS)),
    ],
)
def test_unknown_choice_lists_the_choices(field, label, allowed):
    message = refused(**{field: "no-such-thing"})
    assert f"unknown {label} 'no-such-thing'" in message
    assert "choose one of: " + ", ".join(allowed) in message
    # and every listed choice is accepted (for strategy: with a world size it allows, and what the
    # strategy says it needs: a pipeline schedule's blocks and micro-batches, expert parallelism's experts)
    for value in allowed:
        world_size = 1 if field != "strategy" or value == "single" else 2
        config.with_strategy_defaults(RunConfig(**{field: value, "world_size": world_size}))[0].validate()


@pytest.mark.parametrize("value", ["yes", "partial", 1])
def test_an_unknown_recomputation_is_named(value):
    message = refused(activation_checkpointing=value)
    assert f"got {value!r}" in message and "'selective'" in message
    for value in (False, True, "full", "selective"):
        RunConfig(activation_checkpointing=value).validate()


def test_deepspeed_zero3_refuses_selective_recomputation_and_says_why():
    message = refused(strategy="deepspeed-zero3", world_size=2, activation_checkpointing="selective")
    assert "adds the bias onto the product's output in place" in message and "activation_checkpointing=True" in message
    RunConfig(strategy="deepspeed-zero3", world_size=2, activation_checkpointing=True).validate()


def test_single_on_two_processes():
    message = refused(strategy="single", world_size=2)
    assert "world_size=2" in message and "'single'" in message
    assert "use world_size=1 or a parallel strategy such as 'ddp'" in message


@pytest.mark.parametrize("fault", ["boom", "raise@1", "raise@a:1", "explode@1:1", "raise@1:2:3", "kill@@1:1",
                                   "kill@1:2:later"])
def test_bad_fault_string(fault):
    message = refused(strategy="ddp", world_size=2, fault=fault)
    assert repr(fault) in message
    assert "'raise@RANK:STEP', 'kill@RANK:STEP' or 'kill@RANK:STEP:STAGE'" in message


def test_fault_on_a_rank_that_does_not_exist():
    """dp is one process: a fault on its rank 1 would never fire, so it is refused."""
    message = refused(strategy="dp", world_size=2, fault="raise@1:0")
    assert "names rank 1" in message and "1 process(es)" in message


def test_good_fault_string_is_parsed():
    assert config.parse_fault("kill@1:2") == ("kill", 1, 2, None)
    assert config.parse_fault("kill@0:4:written") == ("kill", 0, 4, "written")
    RunConfig(strategy="ddp", world_size=2, fault="raise@0:0").validate()


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(lr=0.0), "lr must be positive, got 0.0"),
        (dict(bucket_cap_mb=-1.0), "bucket_cap_mb must be a positive number of MiB up to 1048576"),
        (dict(seq_len=1), "seq_len must be a whole number >= 2, got 1"),
        (dict(steps=0), "steps must be a whole number >= 1, got 0"),
        (dict(grad_accum_steps=0), "grad_accum_steps must be a whole number >= 1, got 0"),
        (dict(threads_per_worker=0), "threads_per_worker must be a whole number from 1 to 4096"),
        (dict(dataset_size=4, global_batch_size=8), "use at least 8 samples"),
        # what the types behind a flag cannot hold, refused before launch with the range
        (dict(threads_per_worker=2**31), "threads_per_worker must be a whole number from 1 to 4096"),
        (dict(seed=2**64), f"seed must be a whole number from 0 to {2**62}"),
        (dict(seed=-1), f"seed must be a whole number from 0 to {2**62}"),
        (dict(steps=10**10), "steps must be at most 1000000000"),
        (dict(dataset_size=10**12), "give a smaller --dataset-size"),
        (dict(model="gpt-moe-tiny", extra={"moe_capacity_factor": 1e308}), "must be a positive number up to 1e+06"),
    ],
)
def test_other_bad_sizes(fields, expected):
    assert expected in refused(**fields)


def test_from_dict_unknown_field():
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict({"strategy": "ddp", "world_sise": 2})
    message = str(info.value)
    assert "unknown RunConfig field(s): world_sise" in message
    assert "known fields are:" in message and "world_size" in message


def test_dict_and_json_round_trip():
    cfg = RunConfig(strategy="ddp-scratch", world_size=4, seq_len=32, extra={"k": 1}, fault="kill@3:1")
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_derived_sizes():
    cfg = RunConfig(strategy="ddp", world_size=4, grad_accum_steps=2, global_batch_size=32, steps=5)
    assert cfg.per_rank_batch_size == 32 // 4
    assert cfg.micro_batch_size == 32 // (4 * 2)
    # about 16,000 tokens, whatever the steps: a run saved after some steps continues on the same data
    assert cfg.num_samples == DATASET_TOKENS // 64 == cfg.replace(steps=500).num_samples  # gpt-tiny's 64 tokens
    assert cfg.replace(seq_len=48).num_samples == -(-DATASET_TOKENS // 48)
    assert cfg.replace(global_batch_size=2**12).num_samples == 2**12  # at least one global batch
    assert cfg.replace(dataset_size=100).num_samples == 100
    assert cfg.processes == 4
    # dp: N replicas are threads of one process; the batch still splits N ways
    dp = cfg.replace(strategy="dp")
    assert (dp.processes, dp.per_rank_batch_size) == (1, 8)


def test_sequence_longer_than_the_model_takes():
    """gpt-tiny's position table has 64 rows: 65 tokens cannot be placed."""
    with pytest.raises(ConfigError, match=r"seq_len=65 is longer than model 'gpt-tiny' can take \(64 positions\)"):
        RunConfig(model="gpt-tiny", seq_len=65).validate()
    RunConfig(model="gpt-tiny", seq_len=64).validate()
    RunConfig(model="t5-tiny", seq_len=512).validate()  # relative positions: no fixed limit
