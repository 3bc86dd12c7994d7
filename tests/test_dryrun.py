"""Dry runs (multigpu.dryrun): the strategies' own code at up to 1024 ranks on fake tensors, and the estimator
held against them (multigpu.estimator.held): model states to the byte, the collectives' calls and bytes
exactly, the first forward's activations within 5%."""

from __future__ import annotations

import pytest

from multigpu.__main__ import main
from multigpu.dryrun import CANNOT, dry_run, plan
from multigpu.errors import ConfigError
from multigpu.estimator.held import held, rows
from multigpu.models import parameter_count

# (strategy, category) -> a difference over the goal the estimator does not model, and the bound it is held to
OPEN = {("pp-1f1b-scratch", "activations"): (
    "at the end of a forward a 1F1B stage also holds the buffers of transfers in flight (a gradient received "
    "for a coming backward, one being sent back), which the estimator files under 'other'", 0.12)}

PLANS = [  # every strategy that can dry-run, at the largest world gpt-small's shape lets it take
    ("zero1", 1024, {}), ("zero2", 64, {}), ("zero3", 1024, {"grad_accum_steps": 2}),
    ("ddp-scratch", 1024, {}), ("tp", 8, {}), ("tp-scratch", 8, {}), ("fsdp", 1024, {"tp": 8}),
    ("fsdp", 64, {"tp": 4, "extra": {"sequence_parallel": True}}),
    ("fsdp", 64, {"grad_accum_steps": 2}), ("fsdp", 1024, {"tp": 2, "cp": 2}),
    ("fsdp", 64, {"tp": 2, "cp": 2, "extra": {"sequence_parallel": True}}),
    ("pp-1f1b-scratch", 4, {"grad_accum_steps": 4}),
    ("pp-gpipe-scratch", 3, {"grad_accum_steps": 3}), ("cp-scratch", 4, {}),
]


@pytest.mark.parametrize("strategy,world,options", PLANS, ids=lambda x: str(x))
def test_the_estimator_equals_the_dry_run(strategy, world, options):
    found = held(strategy, world, "gpt-small", **options)
    assert found, "the estimator models every plan here"
    wrong = [r for r in found if r["within_goal"] is False
             and not ((strategy, r["category"]) in OPEN and abs(r["relative"]) <= OPEN[strategy, r["category"]][1])]
    assert not wrong, [(r["role"], r["category"], r["estimate"], r["dry_run"]) for r in wrong]
    assert any(r["category"] == "activations" and r["within_goal"] for r in found)


def test_fsdp_at_1024_ranks_holds_its_padded_rows():
    """Independent of the estimator (which counts the same padding from the same shapes, above): FSDP2 cuts
    each tensor along its first dimension into n chunks of ceil(rows / n) rows, so at 1024 ranks a tensor of 256
    rows leaves most ranks one row of padding. The dry run holds exactly that."""
    import math

    import torch

    from multigpu.models import build_model

    with torch.device("meta"):
        model = build_model("gpt-small")
    padded = sum(math.ceil(p.shape[0] / 1024) * p[0].numel() * 4 for p in dict.fromkeys(model.parameters()))
    cfg = plan("fsdp", 1024, "gpt-small")
    run = dry_run(cfg)
    assert run.model_states["params"] == run.model_states["grads"] == padded
    assert run.model_states["optimizer"] == 2 * padded
    assert {c["group_size"] for c in run.collectives} == {1024}
    assert [r for r in rows(cfg, run) if not r["within_goal"]] == []  # the estimator, as for PLANS


@pytest.mark.parametrize("strategy,world,options", [
    ("fsdp", 1024, {"tp": 4}), ("zero3", 1024, {"grad_accum_steps": 2}),
    ("pp-1f1b-scratch", 2, {"grad_accum_steps": 4}), ("cp-scratch", 4, {})], ids=lambda x: str(x))
def test_real_tensors_hold_what_fake_ones_count(strategy, world, options):
    """`materialize`: the same rank with real tensors on this CPU (the group still fake) keeps, leaves for
    backward and sends exactly what the fake run counts: the fake run's counts are real memory."""
    cfg = plan(strategy, world, "gpt-tiny", **options)
    fake, real = dry_run(cfg), dry_run(cfg, materialize="cpu")
    assert real.materialized == "cpu" and fake.materialized is None and real.allocator_peak_bytes is None
    for field in ("model_states", "forward_saved", "forward_gathered", "collectives"):
        assert getattr(real, field) == getattr(fake, field), field


def test_materialize_refuses_what_this_machine_cannot_hold(monkeypatch):
    from multigpu import dryrun

    cfg = plan("fsdp", 64, "gpt-small")
    assert "cpu or cuda" in dryrun.materialize_problem(cfg, "tpu")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert "no CUDA GPU" in dryrun.materialize_problem(cfg, "cuda")
    monkeypatch.setattr(dryrun, "_available_host_bytes", lambda: 2**20)
    with pytest.raises(ConfigError, match="without --materialize"):
        dry_run(cfg, materialize="cpu")


def test_a_real_size_model_at_64_ranks(tmp_path):
    """T5-3B's shape (configs/t5-3b.json) under ZeRO-3 over 64 ranks: its 2.9e9 parameters' share, in seconds,
    on this CPU, with nothing allocated for them."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "t5-3b.json"
    found = held("zero3", 64, str(config), seq_len=128)
    states = {r["category"]: r for r in found if r["category"] in ("params", "grads", "optimizer")}
    assert all(r["within_goal"] for r in states.values()), states
    assert states["params"]["dry_run"] == pytest.approx(parameter_count(str(config)) * 4 / 64, rel=0.01)
    assert next(r for r in found if r["category"] == "activations")["within_goal"]


def test_what_cannot_dry_run_says_why():
    with pytest.raises(ConfigError, match="reads every parameter's memory"):
        plan("ddp", 8, "gpt-small")
    assert set(CANNOT) >= {"ddp", "dp", "pp-1f1b", "ep-scratch"}


@pytest.mark.parametrize("argv,message", [
    (["--strategy", "fsdp", "--tp", "8", "--world-size", "64", "--model", "gpt2"], "does not divide the 12"),
    (["--strategy", "fsdp", "--world-size", "64", "--model", "missing.json"], "neither a preset"),
    (["--strategy", "fsdp", "--world-size", "100", "--tp", "8"], "100"),
    (["--strategy", "fsdp", "--model", "gpt-small"], "needs --world-size"),
    (["--strategy", "ddp", "--world-size", "8"], "cannot be dry-run"),
])
def test_bad_plans_are_refused_with_what_to_change(argv, message, capsys):
    assert main(["dryrun", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_command_prints_the_estimate_beside_the_dry_run(capsys):
    assert main(["dryrun", "--strategy", "zero3", "--world-size", "1024", "--model", "gpt-small"]) == 0
    out = capsys.readouterr().out
    assert "zero3 on 1024 ranks" in out and "params" in out and "all_gather" in out and "over  1024 ranks" in out


def test_out_of_memory_is_a_message(monkeypatch):
    import multigpu.models

    def too_big(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(multigpu.models, "build_model", too_big)
    with pytest.raises(ConfigError, match="ran out of this machine's memory"):
        dry_run(plan("fsdp", 8, "gpt-small"))


def test_the_advisor_dry_runs_its_plan(capsys):
    """advise --dry-run: the recommended plan and the runner-up at their full size, measured beside the estimates;
    a plan with no dry-runnable strategy says why instead."""
    from multigpu.estimator.held import config_of
    from multigpu.estimator.question import Setup

    assert main(["advise", "--model", "gpt-small", "--gpus", "64", "--gpu-memory", "16GiB", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "recommended, dry-run:" in out and "runner-up, dry-run:" in out and "over    64 ranks" in out
    with pytest.raises(ConfigError, match="from-scratch stand-in takes no other degree"):
        config_of(Setup("gpt-small", "pp-1f1b", 8, pp=4, grad_accum_steps=4), 16)


def test_a_hugging_face_decoder_is_estimated_and_equals_its_dry_run(tmp_path):
    """A Llama (a config.json built by transformers) under FSDP: the estimator traces it as built, and its model
    states and collectives equal the dry run's; tensor parallelism, which the estimator models for the package's
    GPT only, is refused with that reason."""
    from multigpu.estimator import Setup, estimate
    from multigpu.hf import write_tiny_llama_config

    config = str(write_tiny_llama_config(tmp_path / "llama.json"))
    for options in ({}, {"dtype": "bf16-mixed", "activation_checkpointing": True}):
        found = held("fsdp", 8, config, **options)
        # the activations too: the logits a Hugging Face model returns with its loss are dropped in training
        assert found and all(r["difference"] == 0 for r in found), found
    with pytest.raises(ConfigError, match="estimated for the package's GPT"):
        estimate(Setup(config, "fsdp", 8, tp=2), 8)


def test_a_config_with_a_count_of_zero_names_the_setting(tmp_path, capsys):
    """A llama config.json with num_attention_heads 0 was refused with transformers' ZeroDivisionError alone."""
    import json

    from multigpu.hf import TINY_LLAMA

    config = tmp_path / "llama.json"
    config.write_text(json.dumps({**TINY_LLAMA, "num_attention_heads": 0}))
    assert main(["dryrun", "--strategy", "fsdp", "--world-size", "2", "--model", str(config)]) == 2
    err = capsys.readouterr().err
    assert "'num_attention_heads' is 0; it must be a whole number >= 1" in err and "ZeroDivision" not in err, err


def test_a_hugging_face_plan_says_what_the_estimator_does_not_model(tmp_path, capsys):
    """A plan the estimator has no rows for says why, and its text shows the activations the dry run measured."""
    from multigpu.hf import write_tiny_llama_config

    config = str(write_tiny_llama_config(tmp_path / "llama.json"))
    assert main(["dryrun", "--strategy", "fsdp", "--tp", "2", "--world-size", "4", "--model", config]) == 0
    out = capsys.readouterr().out
    assert "measurements only: the estimator does not model" in out and "package's GPT" in out, out
    assert "activations" in out, out


def test_fsdp2s_view_warning_on_t5_is_not_shown():
    """FSDP2 warns that a T5 block returns a view (an in-place op on it would skip the all-gather); the package's
    T5 under fsdp trains as one device does (that check, here), so the dry run does not pass the warning on."""
    import warnings

    from multigpu.check import check

    assert check("fsdp", 2, steps=2, model="t5-tiny", dataset="dummy")["passed"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dry_run(plan("fsdp", 2, "t5-tiny"))
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]
