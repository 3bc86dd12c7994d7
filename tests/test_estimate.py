"""The estimator (multigpu.estimate) against references: parameter counts of the built
models, and activations traced on fake tensors against activations measured on real ones."""

import json

import pytest
import torch

from multigpu.config import ConfigError
from multigpu.estimate import activation_cost, model_shape
from multigpu.memory import PeakMemoryTracker
from multigpu.models import (GPT_SIZES, apply_activation_checkpointing, build_model, compute_loss,
                             count_parameters, t5_config, vocab_size)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small", "gpt2", "t5-tiny", "t5-small", "t5-large"])
def test_parameter_count_is_the_built_models(name):
    with torch.device("meta"):
        assert model_shape(name).parameters == count_parameters(build_model(name))


def test_hugging_face_config_files_give_the_presets_counts(tmp_path):
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps({**t5_config("t5-small").to_dict(), "model_type": "t5"}))
    assert model_shape(str(t5)).parameters == model_shape("t5-small").parameters
    cfg = GPT_SIZES["gpt2"]
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer,
                                "n_head": cfg.n_head, "n_embd": cfg.d_model, "n_positions": cfg.seq_len}))
    assert model_shape(str(gpt2)).parameters == 124_439_808  # GPT-2 small as released


def _measured_saved(name, batch, seq, target=None, dtype="fp32", checkpointing=False):
    model = build_model(name)
    if checkpointing:
        apply_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size(name), (batch, seq), generator=g)
    labels = torch.randint(vocab_size(name), (batch, target or seq), generator=g)
    with PeakMemoryTracker(model) as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16-mixed"):
            compute_loss(model, {"input_ids": ids, "labels": labels}).backward()
    return tracker.saved_activation_bytes


@pytest.mark.parametrize("name, seq, target, dtype, checkpointing", [
    ("gpt-small", 128, None, "fp32", False),
    ("gpt-small", 64, None, "bf16-mixed", False),
    ("gpt-small", 128, None, "fp32", True),
    ("t5-tiny", 32, 16, "fp32", False),
    ("t5-tiny", 32, 32, "fp32", True),
])
def test_traced_activations_equal_measured(name, seq, target, dtype, checkpointing):
    cost = activation_cost(name, seq, target, dtype, checkpointing)
    for batch in (3, 5):  # neither of the traced batch sizes
        assert cost.saved(batch) == _measured_saved(name, batch, seq, target, dtype, checkpointing)


@pytest.mark.parametrize("model, says", [
    ("params:abc", "positive number"),
    ("params:0", "positive number"),
    ("no-such-model", "neither a preset"),
])
def test_bad_models_are_named(model, says):
    with pytest.raises(ConfigError, match=says):
        model_shape(model)


def test_unsupported_config_and_count_only_activations_are_explained(tmp_path):
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="t5 and gpt2"):
        model_shape(str(bert))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        model_shape(str(broken))
    with pytest.raises(ConfigError, match="no activations"):
        activation_cost("params:7.5e9", 256)
