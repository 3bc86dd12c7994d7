"""What a model is and what its forward keeps, counted without running it.

- `model_shape`: parameter counts of a model built on the meta device (no memory, no
  weights): a preset, a Hugging Face config.json (t5 or gpt2), or "params:<count>";
  `gpt_parts`: the package's GPT counted as tensor and pipeline parallelism divide it.
- `activation_cost`: the model runs one forward pass on fake tensors (`FakeTensorMode`:
  shapes and dtypes, no data) for one sample and for two, and the bytes still alive when
  forward returns (what it saved for backward) give a fixed part and a per-sample part.
  Saved activations grow linearly with the batch (the one-device chapter measures it), so
  every batch size after that is arithmetic.

multigpu.estimator.share and .peak put these together into a step's peak per rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from multigpu.config import ATTENTION  # how attention is computed: one fused call, or op by op
from multigpu.errors import ConfigError
from multigpu.moe import even_routing
from multigpu.moe import layers as moe_layers


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
    # a mixture of experts (0: a dense model): its routed experts' parameters, the largest tensor among and
    # outside them, E and k
    expert_parameters: int = 0
    largest_expert_tensor: int = 0
    largest_dense_tensor: int = 0
    experts: int = 0
    top_k: int = 0

    @property
    def active_parameters(self) -> int:  # what one token computes with: the dense part, k of every E experts
        from multigpu.estimator.formulas import moe_active_parameters

        return moe_active_parameters(self.parameters, self.expert_parameters, self.experts or 1, self.top_k or 1)


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
    encoder: tuple[int, int] = (0, 0)  # an encoder-decoder's encoder: alive until backward reaches it

    def saved(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch

    def encoder_saved(self, batch: int) -> int:
        return self.encoder[0] + self.encoder[1] * batch

    def freed_first(self, batch: int) -> tuple[int, int]:
        """(tail, last block) bytes at this batch."""
        return self.tail[0] + self.tail[1] * batch, self.last_block[0] + self.last_block[1] * batch


def _build(model: str) -> tuple[nn.Module, str]:
    """The model named by `model`: a preset, or a Hugging Face config.json (t5 or gpt2)."""
    from multigpu.models import PRESETS, ModelConfigError, build_from_config_file, build_model

    if model in PRESETS:
        return build_model(model), PRESETS[model][0]
    try:  # a Hugging Face decoder (a Llama) is traced as built; tensor and pipeline parallelism cut GPT only
        return build_from_config_file(model)
    except ModelConfigError as e:
        hint = "" if Path(model).is_file() else ", nor params:<count> (e.g. params:7.5e9)"
        raise ConfigError(f"{e}{hint}") from None


def meta_model(model: str) -> tuple[nn.Module, str]:
    """(model, family) on the meta device: its modules and shapes, no storage."""
    with torch.device("meta"):
        return _build(model)


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

    built, family = meta_model(model)
    blocks = transformer_blocks(built)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    params = list(dict.fromkeys(built.parameters()))  # a tied weight once
    total = sum(p.numel() for p in params)
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    outside = sum(p.numel() for p in params if id(p) not in in_blocks)
    vocab = built.cfg.vocab_size if family == "gpt" else built.config.vocab_size
    moe = moe_layers(built)
    routed = {id(p) for layer in moe for p in layer.experts.parameters()}
    return ModelShape(model, total, largest, outside, blocks=len(blocks),
                      largest_tensor=max(p.numel() for p in params), vocab_size=vocab, family=family,
                      tensors=len(params), expert_parameters=sum(p.numel() for p in params if id(p) in routed),
                      largest_expert_tensor=max((p.numel() for p in params if id(p) in routed), default=0),
                      largest_dense_tensor=max(p.numel() for p in params if id(p) not in routed),
                      experts=moe[0].experts_total if moe else 0, top_k=moe[0].top_k if moe else 0)


@dataclass(frozen=True)
class GPTParts:
    """A GPT's parameters as tensor and pipeline parallelism divide them: tensor parallelism
    cuts every weight matrix and the vocabulary (strategies/tp_plan.py's plan) and leaves the
    LayerNorms, the row-parallel biases and the position table whole; a pipeline stage owns
    a run of blocks (strategies/pp_split.py), the first also the embeddings, the last also
    the final norm and the head (a copy of the embedding's weight when they are tied)."""

    layers: int
    d_model: int
    d_ff: int
    heads: int
    block_cut: int  # per block: q, k, v, the two projections and the MLP's matrices, the column-parallel biases
    block_whole: int  # per block: LayerNorms and row-parallel biases
    largest_matrix: int  # elements of a block's largest weight (the MLP's)
    embedding: int  # the token embedding, cut by vocabulary
    positions: int  # the position table (the library cuts it by position under sequence parallelism)
    final_norm: int
    head: int  # the head's weight, cut by vocabulary
    tied: bool  # the head is the token embedding's weight


@lru_cache(maxsize=32)
def gpt_parts(model: str) -> GPTParts:
    """The parts of the package's GPT named by `model`, counted on the meta device."""
    from multigpu.models import GPT

    built, _ = meta_model(model)
    if not isinstance(built, GPT):
        raise ConfigError(f"{model} is not the package's GPT: tensor and pipeline parallelism cut that model only")
    cfg, block = built.cfg, built.blocks["0"]

    def whole(name: str) -> bool:  # what every tensor-parallel rank keeps whole
        return name.startswith("ln_") or name.endswith("proj.bias")

    named = dict(block.named_parameters())
    return GPTParts(
        layers=cfg.n_layer, d_model=cfg.d_model, d_ff=cfg.d_ff, heads=cfg.n_head,
        block_cut=sum(p.numel() for n, p in named.items() if not whole(n)),
        block_whole=sum(p.numel() for n, p in named.items() if whole(n)),
        largest_matrix=max(p.numel() for p in named.values()),
        embedding=built.wte.weight.numel(), positions=built.wpe.weight.numel(),
        final_norm=sum(p.numel() for p in built.ln_f.parameters()), head=built.lm_head.weight.numel(),
        tied=cfg.tie_embeddings)

DEVICE_KINDS = ("cpu", "cuda")


# What CUDA keeps for backward of a fused attention call given a floating-point mask (T5's position
# bias): two copies of the mask, batch-wide (batch x heads x queries x keys). Measured, not derived:
# T5's SDPA runs on an H200 (torch 2.11; results/1xH200-nccl, machine_peak and t5_largest_batch) held
# this beyond the output and log-sum-exp, within 2% from t5-small to t5-large, batch 8 to 16
MASK_COPIES_ON_CUDA = 2


class _AliveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage an operator creates (outside `skip`), to count those still alive, as
    two devices keep them. Traced here, a dropout draws its mask with `bernoulli_` into a
    tensor of the input's type (ATen's `_dropout_impl`, what a CPU runs); CUDA runs
    `native_dropout`, whose mask is a bool per element. And a CPU computes
    `scaled_dot_product_attention` with dropout, or with a mask that needs a gradient (T5's
    position bias), by its math backend, which keeps the S x S probabilities (and their
    dropout mask), where CUDA's fused kernels keep the output and one log-sum-exp per row
    (a dropout inside them keeps only its random seed) and, given a floating-point mask, two
    batch-wide copies of it (`MASK_COPIES_ON_CUDA`)."""

    def __init__(self, skip: set):
        super().__init__()
        self.skip, self.refs = skip, {}
        self.masks, self.fused = {}, set()  # mask storage -> its elements; storages made inside attention
        self.in_attention, self.attention_keeps = False, []  # per call: (the storages it made, bytes CUDA keeps)
        self.made_in_call: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.bernoulli_:  # a dropout's mask, drawn in place
            self.masks[args[0].untyped_storage()._cdata] = args[0].numel()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata  # the address of the storage: a freed one's may be reused
                if key not in self.skip and (key not in self.refs or self.refs[key][0].expired()):
                    self.refs[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.masks.pop(key, None)
                    (self.fused.add if self.in_attention else self.fused.discard)(key)
                    if self.in_attention:
                        self.made_in_call.append(self.refs[key][0])
        return out

    def attention(self, sdpa):
        """`scaled_dot_product_attention`, its calls marked: what they make is the fused kernel's."""
        def call(query, key, value, *args, **kwargs):
            self.in_attention, self.made_in_call = True, []
            try:
                out = sdpa(query, key, value, *args, **kwargs)
            finally:
                self.in_attention = False
            rows = out.numel() // out.shape[-1]
            mask = kwargs.get("attn_mask", args[0] if args else None)
            masks = (MASK_COPIES_ON_CUDA * rows * key.shape[-2] * mask.element_size()
                     if isinstance(mask, torch.Tensor) and mask.is_floating_point() else 0)
            self.attention_keeps.append((self.made_in_call, out.untyped_storage().nbytes() + rows * 4 + masks))
            return out
        return call

    def alive_bytes(self, device: str = "cpu") -> int:
        alive = {k: n for k, (ref, n) in self.refs.items() if not ref.expired()}
        if device == "cpu":
            return sum(alive.values())
        kept = sum(n for k, n in alive.items() if k not in self.fused)
        masks = sum(alive[k] - self.masks[k] for k in self.masks if k in alive and k not in self.fused)
        # a call's keeps count while anything it made lives (what this device's kernel keeps for backward): a
        # fully recomputed block frees all of it when its forward ends, and CUDA's would be freed with it
        return kept - masks + sum(n for made, n in self.attention_keeps if any(not ref.expired() for ref in made))


@lru_cache(maxsize=64)
def activation_cost(model: str, seq_len: int, target_len: int | None = None, weights: str = "fp32",
                    autocast: bool | str = False, checkpointing: bool | str = False, dropout: bool = True,
                    attention: str = "sdpa", device: str = "cpu") -> ActivationCost:
    """Saved activations of `model`, from forward passes on fake tensors at batch 1 and 2:
    the bytes alive when forward returns, its output included (a T5 model returns its
    logits; GPT returns the loss only), as `PeakMemoryTracker` measures them.
    `target_len`: the decoder's length for encoder-decoder models (default: `seq_len`);
    `weights`: "fp32" or "bf16" (what the layers compute with); `autocast`: bf16 (True or
    "bf16") or fp16 ("fp16") autocast
    around forward (with fp32 weights it also keeps bf16 copies of them); `dropout`: the
    model's own dropout (False: none, as the parity tests train); `attention`: "sdpa" or
    "eager" (T5 can run either; the package's GPT runs sdpa); `device`: "cpu" or "cuda",
    which keep a dropout's mask and fused attention differently (`_AliveStorages`)."""
    if device not in DEVICE_KINDS:
        raise ConfigError(f"device must be one of {', '.join(DEVICE_KINDS)}, got {device!r}")
    # one question, one key: a T5's decoder length defaults to its encoder's, a decoder has none (the
    # chapters ask for T5 both ways, and each key is a trace of its own)
    target_len = (target_len or seq_len) if model_shape(model).family == "t5" else None
    return _activation_costs(model, seq_len, target_len, weights, autocast, checkpointing, dropout, attention)[device]


@lru_cache(maxsize=64)
def _activation_costs(*args) -> dict[str, ActivationCost]:
    """`_traced_costs(*args)`, kept for this process; and, where MULTIGPU_TRACE_CACHE names a folder,
    on disk for the processes that follow (the test suite executes a chapter once per fake GPU
    server, each in a new kernel: a trace takes a second or two). The key holds the arguments, a
    config file's text, the versions of torch and transformers and the source of the code that
    builds and traces the models (moe.py: a mixture of experts'; recompute.py: what a checkpointed block keeps),
    so a changed one is traced again."""
    import hashlib
    import os
    import pickle

    folder = os.environ.get("MULTIGPU_TRACE_CACHE")
    if not folder:
        return _traced_costs(*args)
    import transformers

    from multigpu import hf, loss, models, moe, recompute

    sources = (models, hf, loss, recompute, *((moe,) if model_shape(args[0]).experts else ()))
    parts = [repr(args), torch.__version__, transformers.__version__, Path(__file__).read_text(),
             *(Path(m.__file__).read_text() for m in sources)]
    if str(args[0]).endswith(".json") and Path(args[0]).is_file():
        parts.append(Path(args[0]).read_text())
    path = Path(folder) / f"{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()}.pickle"
    if path.exists():
        return pickle.loads(path.read_bytes())
    costs = _traced_costs(*args)
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_suffix(f".{os.getpid()}.tmp")
    aside.write_bytes(pickle.dumps(costs))
    os.replace(aside, path)  # whole or not at all, if two processes trace the same model at once
    return costs


def _traced_costs(model: str, seq_len: int, target_len: int | None, weights: str, autocast: bool | str,
                  checkpointing: bool | str, dropout: bool, attention: str) -> dict[str, ActivationCost]:
    """`activation_cost` for every device kind, from one trace."""
    from unittest import mock

    from multigpu.models import apply_activation_checkpointing, transformer_blocks

    shape = model_shape(model)
    if shape.vocab_size is None:
        raise ConfigError(f"{model}: a bare parameter count has no activations to estimate, so it gives the model "
                          "states alone; batch sizes need a preset or a config.json")
    if weights not in ("fp32", "bf16"):
        raise ConfigError(f"weights must be fp32 or bf16, got {weights!r}")
    if attention not in ATTENTION:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    built, family, mode = _fake_model(model, torch.bfloat16 if weights == "bf16" else torch.float32)
    if family == "gpt" and attention != "sdpa":
        raise ConfigError(f"{model}: the package's GPT computes attention with scaled_dot_product_attention only "
                          "(attention sdpa); eager attention is a T5 option")
    if family == "t5":
        from multigpu.hf import set_attention

        set_attention(built, attention)  # every layer's config, checked
    if not dropout:
        built.eval()  # nothing else in these models depends on training mode
    positions = built.cfg.seq_len if family == "gpt" else None
    if positions is not None and seq_len > positions:
        raise ConfigError(f"{model} has {positions} positions, so a sample holds at most {positions} tokens; "
                          f"got {seq_len}: pass --seq-len {positions} or less")
    if checkpointing:
        apply_activation_checkpointing(built, checkpointing)
    target_len = target_len or seq_len
    saved, tail, last, encoder = ({d: {} for d in DEVICE_KINDS} for _ in range(4))
    encoder_blocks = len(built.encoder.block) if family == "t5" else 0
    blocks = transformer_blocks(built)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with mode, even_routing():  # a mixture of experts: a balanced load (fake tensors hold no scores)
        skip = {t.untyped_storage()._cdata for t in [*built.parameters(), *built.buffers()]}
        # T5's position bias, an attention mask that broadcasts over the batch, is used as it is at
        # batch 1 and copied batch-wide inside the attention call from batch 2 on: where that copy
        # separates the devices (sdpa), the CUDA line is taken between batches 2 and 3
        batches = (1, 2, 3) if family == "t5" and attention == "sdpa" else (1, 2)
        for batch in batches:
            ids = torch.randint(shape.vocab_size, (batch, seq_len))
            labels = torch.randint(shape.vocab_size, (batch, target_len if family == "t5" else seq_len))
            marks = []  # alive bytes after each block's forward, per device kind
            with torch.autocast("cpu", dtype=torch.float16 if autocast == "fp16" else torch.bfloat16,
                                enabled=bool(autocast)):
                with _AliveStorages(skip) as alive, \
                        mock.patch("torch.nn.functional.scaled_dot_product_attention", alive.attention(sdpa)):
                    # as PeakMemoryTracker counts: at forward's return
                    hooks = [b.register_forward_hook(
                        lambda *_, add=marks.append, alive=alive: add({d: alive.alive_bytes(d) for d in DEVICE_KINDS}))
                        for b in blocks]
                    out = built(input_ids=ids, labels=labels)
                    for d in DEVICE_KINDS:
                        saved[d][batch] = alive.alive_bytes(d)
                    for h in hooks:
                        h.remove()
            del out
            for d in DEVICE_KINDS:
                ends = [m[d] for m in marks[-2:]] if len(marks) >= 2 else [0, *(m[d] for m in marks)]
                tail[d][batch], last[d][batch] = saved[d][batch] - ends[-1], ends[-1] - ends[-2]
                encoder[d][batch] = marks[encoder_blocks - 1][d] if encoder_blocks else 0
    logits = (target_len if family == "t5" else seq_len) * shape.vocab_size * 4

    def line(by_batch, device):  # (fixed, per sample) through batch 1 and 2 (CUDA: the last two traced)
        a, b = (1, 2) if device == "cpu" else batches[-2:]
        per_sample = (by_batch[b] - by_batch[a]) / (b - a)
        return (round(by_batch[a] - a * per_sample), round(per_sample))

    return {d: ActivationCost(fixed=line(saved[d], d)[0], per_sample=line(saved[d], d)[1], logits_per_sample=logits,
                              tail=line(tail[d], d), last_block=line(last[d], d), encoder=line(encoder[d], d))
            for d in DEVICE_KINDS}
