"""What a model is and what its forward keeps, counted without running it.

- `model_shape`: parameter counts of a model built on the meta device (no memory, no
  weights): a preset, a Hugging Face config.json (t5 or gpt2), or "params:<count>".
- `activation_cost`: the model runs one forward pass on fake tensors (`FakeTensorMode`:
  shapes and dtypes, no data) for one sample and for two, and the bytes still alive when
  forward returns (what it saved for backward) give a fixed part and a per-sample part.
  Saved activations grow linearly with the batch (the one-device chapter measures it), so
  every batch size after that is arithmetic.

multigpu.estimate puts these together into a step's peak per rank.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
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
    blocks: int  # transformer blocks
    largest_tensor: int  # elements of the largest parameter (the embedding, in these models)
    vocab_size: int | None  # None: a bare parameter count, no activations known
    family: str | None  # "gpt", "t5" or None
    tensors: int = 0  # parameter tensors (each rounded up to 512 bytes by the CUDA allocator)


@dataclass(frozen=True)
class ActivationCost:
    """Bytes forward keeps for backward: `fixed + per_sample * batch`, per process. Of them,
    `tail` were saved after the last block (final norm, head, loss) and `last_block` by the
    last block: backward frees those first."""

    fixed: int
    per_sample: int
    logits_per_sample: int  # bytes of one sample's fp32 logits (the loss's temporaries scale with it)
    tail: tuple[int, int] = (0, 0)  # (fixed, per sample)
    last_block: tuple[int, int] = (0, 0)

    def saved(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch

    def freed_first(self, batch: int) -> tuple[int, int]:
        """(tail, last block) bytes at this batch."""
        return self.tail[0] + self.tail[1] * batch, self.last_block[0] + self.last_block[1] * batch


def _build(model: str) -> tuple[nn.Module, str]:
    """The model named by `model`: a preset, or a Hugging Face config.json (t5 or gpt2)."""
    from multigpu.models import PRESETS, ModelConfigError, build_from_config_file, build_model, family

    if model in PRESETS:
        return build_model(model), PRESETS[model][0]
    try:
        if family(model) == "causal-lm":
            kind = json.loads(Path(model).read_text())["model_type"]
            raise ConfigError(f"{model}: model_type {kind!r} is not supported; the estimator knows t5 and gpt2 "
                              "configs (or give params:<count> for model states only)")
        return build_from_config_file(model)
    except ModelConfigError as e:
        hint = "" if Path(model).is_file() else ", nor params:<count> (e.g. params:7.5e9)"
        raise ConfigError(f"{e}{hint}") from None


def _fake_model(model: str, dtype: torch.dtype = torch.float32):
    """(model, family, mode) with fake weights of `dtype`: shapes only, nothing allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode, default = FakeTensorMode(), torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with mode:
            built, family = _build(model)
    finally:
        torch.set_default_dtype(default)
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
            raise ConfigError(f"--model {model!r}: the count after params: must be a positive number, "
                              "e.g. params:7.5e9")
        return ModelShape(model, n, largest_block=0, outside_blocks=n, blocks=0, largest_tensor=0,
                          vocab_size=None, family=None)
    from multigpu.models import transformer_blocks

    with torch.device("meta"):
        built, family = _build(model)
    blocks = transformer_blocks(built)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    params = list(dict.fromkeys(built.parameters()))  # a tied weight once
    total = sum(p.numel() for p in params)
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    outside = sum(p.numel() for p in params if id(p) not in in_blocks)
    vocab = built.cfg.vocab_size if family == "gpt" else built.config.vocab_size
    return ModelShape(model, total, largest, outside, blocks=len(blocks),
                      largest_tensor=max(p.numel() for p in params), vocab_size=vocab, family=family,
                      tensors=len(params))


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
def activation_cost(model: str, seq_len: int, target_len: int | None = None, weights: str = "fp32",
                    autocast: bool = False, checkpointing: bool = False) -> ActivationCost:
    """Saved activations of `model`, from forward passes on fake tensors at batch 1 and 2:
    the bytes alive when forward returns, its output included (a T5 model returns its
    logits; GPT returns the loss only), as `PeakMemoryTracker` measures them.
    `target_len`: the decoder's length for encoder-decoder models (default: `seq_len`);
    `weights`: "fp32" or "bf16" (what the layers compute with); `autocast`: bf16 autocast
    around forward (with fp32 weights it also keeps bf16 copies of them)."""
    from multigpu.models import apply_activation_checkpointing, transformer_blocks

    shape = model_shape(model)
    if shape.vocab_size is None:
        raise ConfigError(f"{model}: a bare parameter count has no activations to estimate, so it gives the model "
                          "states alone; batch sizes need a preset or a config.json")
    if weights not in ("fp32", "bf16"):
        raise ConfigError(f"weights must be fp32 or bf16, got {weights!r}")
    built, family, mode = _fake_model(model, torch.bfloat16 if weights == "bf16" else torch.float32)
    positions = built.cfg.seq_len if family == "gpt" else None
    if positions is not None and seq_len > positions:
        raise ConfigError(f"{model} has {positions} positions, so a sample holds at most {positions} tokens; "
                          f"got {seq_len}: pass --seq-len {positions} or less")
    if checkpointing:
        apply_activation_checkpointing(built)
    target_len = target_len or seq_len
    saved, tail, last = {}, {}, {}
    blocks = transformer_blocks(built)
    with mode:
        skip = {t.untyped_storage()._cdata for t in [*built.parameters(), *built.buffers()]}
        for batch in (1, 2):
            ids = torch.randint(shape.vocab_size, (batch, seq_len))
            labels = torch.randint(shape.vocab_size, (batch, target_len if family == "t5" else seq_len))
            marks = []  # alive bytes after each block's forward
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                with _AliveStorages(skip) as alive:  # as PeakMemoryTracker counts: at forward's return
                    hooks = [b.register_forward_hook(lambda *_, add=marks.append, alive=alive: add(alive.alive_bytes()))
                             for b in blocks]
                    out = built(input_ids=ids, labels=labels)
                    saved[batch] = alive.alive_bytes()
                    for h in hooks:
                        h.remove()
            del out
            ends = marks[-2:] if len(marks) >= 2 else [0, *marks]
            tail[batch], last[batch] = saved[batch] - ends[-1], ends[-1] - ends[-2]
    per_sample = saved[2] - saved[1]
    logits = (target_len if family == "t5" else seq_len) * shape.vocab_size * 4

    def line(by_batch):  # (fixed, per sample) through batch 1 and 2
        return (2 * by_batch[1] - by_batch[2], by_batch[2] - by_batch[1])

    return ActivationCost(fixed=saved[1] - per_sample, per_sample=per_sample, logits_per_sample=logits,
                          tail=line(tail), last_block=line(last))
