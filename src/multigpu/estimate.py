"""Memory per rank, estimated before anything runs.

Two parts, derived differently:

- **Model states** (parameters, gradients, optimizer state) follow the ZeRO paper's formulas
  (`multigpu.memory.zero_model_states`), from the exact parameter count of the model, built
  on the meta device (no memory, no weights).
- **Activations** are *traced once*: the model runs one forward pass on fake tensors
  (`FakeTensorMode`: shapes and dtypes, no data) for one sample and for two, and the bytes
  still alive when forward returns (what it saved for backward) give a fixed part and a
  per-sample part. Saved activations grow linearly with the batch (the one-device chapter
  measures it), so every batch size after that is arithmetic: no candidate is traced.

What a step holds at its peak is then put together phase by phase (`estimate`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from multigpu.config import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """What the estimator needs to know about a model."""

    name: str
    parameters: int
    largest_block: int  # parameters of the largest transformer block (a ZeRO-3 / FSDP unit)
    outside_blocks: int  # parameters outside every block (embeddings, final norm, head)
    vocab_size: int | None  # None: a bare parameter count, no activations known
    family: str | None  # "gpt", "t5" or None


@dataclass(frozen=True)
class ActivationCost:
    """Bytes forward keeps for backward: `fixed + per_sample * batch`, per process."""

    fixed: int
    per_sample: int
    logits_per_sample: int  # bytes of one sample's fp32 logits (the loss's temporaries scale with it)

    def saved(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch


def _build(model: str) -> tuple[nn.Module, str]:
    """The model named by `model`: a preset, or a Hugging Face config.json (t5 or gpt2)."""
    from multigpu.models import GPT, PRESETS, GPTConfig, build_model

    if model in PRESETS:
        return build_model(model), PRESETS[model][0]
    path = Path(model)
    if not path.is_file():
        raise ConfigError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}), nor a config.json "
                          "file, nor params:<count> (e.g. params:7.5e9)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path} as a Hugging Face config.json: {e}") from None
    kind = config.get("model_type")
    if kind == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(**{**config, "dropout_rate": 0.0, "use_cache": False,
                          "decoder_start_token_id": config.get("decoder_start_token_id", 0),
                          "pad_token_id": config.get("pad_token_id", 0)})
        return T5ForConditionalGeneration(cfg), "t5"
    if kind == "gpt2":
        # the GPT-2 architecture is the package's GPT; the sizes come from the file
        return GPT(GPTConfig(vocab_size=config["vocab_size"], n_layer=config["n_layer"], n_head=config["n_head"],
                             d_model=config["n_embd"], seq_len=config.get("n_positions", 1024))), "gpt"
    raise ConfigError(f"{path}: model_type {kind!r} is not supported; the estimator knows t5 and gpt2 configs "
                      "(or give params:<count> for model states only)")


def _fake_model(model: str):
    """(model, family) with fake weights: shapes only, nothing allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        built, family = _build(model)
    return built, family, mode


@lru_cache(maxsize=32)
def model_shape(model: str) -> ModelShape:
    """Parameter counts of `model`: a preset, a config.json path, or "params:<count>"."""
    found = re.fullmatch(r"params:(.+)", model)
    if found:
        try:
            n = int(float(found.group(1)))
        except (ValueError, OverflowError):
            n = 0
        if n <= 0:
            raise ConfigError(f"--model {model!r}: the count after params: must be a positive number, e.g. params:7.5e9")
        return ModelShape(model, n, largest_block=0, outside_blocks=n, vocab_size=None, family=None)
    from multigpu.models import transformer_block_types

    with torch.device("meta"):
        built, family = _build(model)
    blocks = [m for m in built.modules() if isinstance(m, transformer_block_types(built))]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    params = list(dict.fromkeys(built.parameters()))  # a tied weight once
    total = sum(p.numel() for p in params)
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    outside = sum(p.numel() for p in params if id(p) not in in_blocks)
    vocab = built.cfg.vocab_size if family == "gpt" else built.config.vocab_size
    return ModelShape(model, total, largest, outside, vocab, family)


class _AliveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage an operator creates (outside `skip`), to count those still alive."""

    def __init__(self, skip: set):
        super().__init__()
        self.skip, self.refs = skip, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata  # the address of the storage: a freed one's may be reused
                if key not in self.skip and (key not in self.refs or self.refs[key][0].expired()):
                    self.refs[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(n for ref, n in self.refs.values() if not ref.expired())


@lru_cache(maxsize=64)
def activation_cost(model: str, seq_len: int, target_len: int | None = None, dtype: str = "fp32",
                    checkpointing: bool = False) -> ActivationCost:
    """Saved activations of `model`, from forward passes on fake tensors at batch 1 and 2:
    the bytes alive when forward returns, its output included (a T5 model returns its
    logits; GPT returns the loss only), as `PeakMemoryTracker` measures them.
    `target_len`: the decoder's length for encoder-decoder models (default: `seq_len`)."""
    from multigpu.models import apply_activation_checkpointing

    shape = model_shape(model)
    if shape.vocab_size is None:
        raise ConfigError(f"{model}: a bare parameter count has no activations to estimate; give a preset or a "
                          "config.json for batch sizes, or leave out --batch-size/--max-batch for model states only")
    built, family, mode = _fake_model(model)
    if checkpointing:
        apply_activation_checkpointing(built)
    target_len = target_len or seq_len
    saved = {}
    with mode:
        skip = {t.untyped_storage()._cdata for t in [*built.parameters(), *built.buffers()]}
        for batch in (1, 2):
            ids = torch.randint(shape.vocab_size, (batch, seq_len))
            labels = torch.randint(shape.vocab_size, (batch, target_len if family == "t5" else seq_len))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16-mixed"):
                with _AliveStorages(skip) as alive:  # as PeakMemoryTracker counts: at forward's return
                    out = built(input_ids=ids, labels=labels)
                    saved[batch] = alive.alive_bytes()
            del out
    per_sample = saved[2] - saved[1]
    logits = (target_len if family == "t5" else seq_len) * shape.vocab_size * 4
    return ActivationCost(fixed=saved[1] - per_sample, per_sample=per_sample, logits_per_sample=logits)
