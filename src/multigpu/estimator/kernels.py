"""A training step as the GPU runs it: its kernels, each priced, not a flat share of the peak.

`step_kernels` runs one micro-batch's forward and backward, and the optimizer's step, on fake
tensors (shapes and dtypes, no data: `model_trace`'s way) and writes down every operator that
launches a kernel, with what it computes and moves:
- a matrix product (`mm`, `addmm`, `bmm`, ...): its FLOPs, 2 m n k;
- attention (`scaled_dot_product_attention`, one fused kernel on a GPU): its two products, whole
  (q x k and the weighted sum; backward runs five, 2.5 times the forward, as FlashAttention's
  backward does: Dao et al. 2022, section 3.1 and appendix B); or, `attention="unfused"`, as
  Megatron-LM ran it before FlashAttention (`CoreAttention`: a batched product for the scores,
  one fused scale-mask-softmax kernel that reads and writes them, a dropout of the probabilities
  when the model trains with one, a batched product with the values), each kernel and its backward
  written down as any other: the scores' bytes, a sequence squared per head, are memory traffic;
- everything else (norms, element-wise ops, softmax, casts, the loss, the optimizer's foreach
  passes): the bytes it reads and writes.
Views launch nothing; operators on 0-d tensors (the optimizer's step counts, on the host) neither.

`kernel_seconds` prices them on a `Compute` (`multigpu.estimator.rates`): a product at the rate the
matmul sweep measured at its size, memory-bound work as bytes over the measured bandwidth, and a
floor per kernel: the host issues kernels one after another at `launch_s` each while the GPU
runs them in order, so a step of many small kernels takes the host's time, a step of large ones
the GPU's (a two-clock walk through the kernels, `timeline`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from multigpu.errors import ConfigError

PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm"}
NO_KERNEL = {"device", "_unsafe_view", "empty", "empty_like", "empty_strided", "detach", "lift_fresh", "alias",
             "set_", "resize_", "_local_scalar_dense", "is_same_size", "new_empty", "new_empty_strided"}
# torch's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): one launch holds at most this many
# chunks of 65,536 elements; a foreach operator launches as many kernels as its tensors need
FOREACH_CHUNK, FOREACH_CHUNKS_PER_LAUNCH = 65536, 320


@dataclass(frozen=True)
class Kernel:
    """One kernel of a step: "product" (`flops`, `size`: the cube root of m n k), "attention" (`flops`,
    `size` as a product's of the same FLOPs) or "memory" (`bytes`); `launches`: kernels it stands for."""

    name: str
    kind: str
    phase: str  # "forward", "backward" (a checkpointed block's second forward among it) or "optimizer"
    flops: float = 0.0
    size: float = 0.0
    bytes: float = 0.0
    dtype: str = "fp32"  # a product's: what its inputs are
    launches: float = 1  # (a pipeline stage's share of them: a fraction)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(ts) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator that would launch a kernel, as a `Kernel`."""

    def __init__(self):
        super().__init__()
        self.kernels: list[Kernel] = []
        self.phase, self.inside_attention, self.recording = "forward", False, True
        self.autocast: str | None = None  # a mixed precision's dtype: CUDA's autocast runs attention in it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.recording or self.inside_attention or func.is_view or name in NO_KERNEL:
            return out
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if all(t.dim() == 0 for t in ins + outs):  # a step count, a scalar: the host's
            return out
        if name in PRODUCTS:
            a, b = (args[1], args[2]) if name.startswith(("add", "badd")) else (args[0], args[1])
            flops = 2.0 * a.numel() * b.shape[-1]
            k = a.shape[-1]
            m = a.numel() // k
            self._add(Kernel(name, "product", self.phase, flops=flops, size=(m * k * b.shape[-1]) ** (1 / 3),
                             dtype=_DTYPE_NAMES.get(a.dtype, "fp32")))
            return out
        moved = _nbytes(outs)
        if name == "embedding":  # reads the rows it gathers, not the table
            moved += 2 * _nbytes(outs[:1]) + _nbytes(ins[1:2])
        else:
            moved += _nbytes(ins)
        launches = 1
        if name.startswith("_foreach_"):
            elements = sum(t.numel() for t in outs or ins)
            launches = max(1, math.ceil(elements / FOREACH_CHUNK / FOREACH_CHUNKS_PER_LAUNCH))
        self._add(Kernel(name, "memory", self.phase, bytes=moved, launches=launches))
        return out

    def _add(self, kernel: Kernel) -> None:
        self.kernels.append(kernel)

    def attention(self, sdpa):
        """`scaled_dot_product_attention` as one fused kernel forward and one backward, whatever its mask (a
        fused kernel takes one): its products, whole."""
        mode = self

        class Fused(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, mask, options):
                mode.inside_attention = True
                try:
                    with torch.no_grad():
                        out = sdpa(q, k, v, attn_mask=mask, **options)
                finally:
                    mode.inside_attention = False
                ctx.shapes = (q, k, v)
                return out

            @staticmethod
            def backward(ctx, grad):
                q, k, v = ctx.shapes
                mode._attention(q, k, v, "backward", 2.5)
                mode.inside_attention = True
                try:
                    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
                finally:
                    mode.inside_attention = False
                return (*grads, None, None)  # (a mask's gradient, T5's position bias's: not priced)

        def call(query, key, value, attn_mask=None, **options):
            self._attention(query, key, value, self.phase, 1.0)
            return Fused.apply(query, key, value, attn_mask, options)
        return call

    def unfused(self, dropout: float):
        """`scaled_dot_product_attention` as Megatron-LM's unfused core attention: the scores made whole,
        one softmax kernel (the scale and the causal or given mask fused into it, as Megatron's
        `FusedScaleMaskSoftmax`: not priced apart), a dropout of the probabilities (CUDA's `native_dropout`:
        the output and a bool mask) when `dropout` > 0, and the product with the values."""
        def call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            if key.shape[-3] != query.shape[-3]:  # grouped-query attention: each kv head serves its group
                key, value = (t.repeat_interleave(query.shape[-3] // t.shape[-3], dim=-3) for t in (key, value))
            scores = torch.matmul(query, key.transpose(-2, -1))
            with torch.autocast("cpu", enabled=False):  # the kernel reads and writes the scores' own dtype
                probs = torch.softmax(scores, dim=-1)
                if dropout > 0:
                    probs = torch.native_dropout(probs, dropout, True)[0]
            return torch.matmul(probs, value)
        return call

    def _attention(self, q, k, v, phase, times):
        rows = q.numel() // q.shape[-1]  # batch x heads x queries
        flops = times * 2.0 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        self._add(Kernel("attention", "attention", phase, flops=flops, size=(flops / 2) ** (1 / 3),
                         dtype=self.autocast or _DTYPE_NAMES.get(q.dtype, "fp32")))


AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


ATTENTION = ("fused", "unfused")


def check_attention(attention: str, dropout: float) -> None:
    """A clear error for an attention kernel or a dropout the kernels cannot price."""
    if attention not in ATTENTION:
        raise ConfigError(f"attention must be fused or unfused, got {attention!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"dropout must be a probability from 0 up to 1, got {dropout!r}")


@lru_cache(maxsize=64)
def step_kernels(model: str, micro_batch: int, seq_len: int, dtype: str = "fp32",
                 activation_checkpointing: bool | str = False, optimizer: str = "adamw", attention: str = "fused",
                 dropout: float = 0.0) -> tuple[Kernel, ...]:
    """The kernels of one micro-batch's forward and backward (phases "forward", "backward") and of one
    optimizer step ("optimizer": torch's foreach AdamW or SGD, as CUDA runs them) of `model` (a preset or a
    config.json) at `micro_batch` samples of `seq_len` tokens; `dtype` "fp32", "bf16-mixed", "fp16-mixed" or
    "bf16-master" (bf16 weights, fp32 optimizer state); `attention` "fused" (one kernel) or "unfused" (Megatron's
    core attention, its probabilities dropped out at `dropout`)."""
    from unittest import mock

    from multigpu.estimator.model_trace import _fake_model, model_shape
    from multigpu.models import apply_activation_checkpointing
    from multigpu.moe import even_routing

    if dtype not in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master"):
        raise ConfigError(f"dtype must be fp32, bf16-mixed, fp16-mixed or bf16-master, got {dtype!r}")
    if micro_batch < 1 or seq_len < 1:
        raise ConfigError(f"a micro-batch of {micro_batch} samples of {seq_len} tokens: give positive sizes")
    check_attention(attention, dropout)
    shape = model_shape(model)
    if shape.vocab_size is None:
        raise ConfigError(f"{model}: a bare parameter count has no kernels to price; give a preset or a config.json")
    built, family, fake = _fake_model(model, torch.bfloat16 if dtype == "bf16-master" else torch.float32)
    positions = getattr(getattr(built, "cfg", None), "seq_len", None) if family == "gpt" else None
    if positions is not None and seq_len > positions:
        raise ConfigError(f"{model} has {positions} positions; got --seq-len {seq_len}: give {positions} or less")
    if activation_checkpointing:
        apply_activation_checkpointing(built, activation_checkpointing)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with fake:
        ids = torch.randint(shape.vocab_size, (micro_batch, seq_len))
    with fake, even_routing(), _Kernels() as trace, \
            mock.patch("torch.nn.functional.scaled_dot_product_attention",
                       trace.attention(sdpa) if attention == "fused" else trace.unfused(dropout)):
        trace.autocast = _DTYPE_NAMES[AUTOCAST[dtype]] if dtype in AUTOCAST else None
        with torch.autocast("cpu", dtype=AUTOCAST.get(dtype, torch.bfloat16), enabled=dtype in AUTOCAST):
            out = built(input_ids=ids, labels=ids)
            loss = out if isinstance(out, torch.Tensor) else out.loss
        trace.phase = "backward"
        loss.backward()
        trace.phase = "optimizer"
        if optimizer == "adamw":
            step = torch.optim.AdamW(built.parameters(), lr=1e-3, foreach=True)
        elif optimizer in ("sgd", "sgd-momentum"):
            step = torch.optim.SGD(built.parameters(), lr=1e-3, momentum=0.9 if optimizer == "sgd-momentum" else 0,
                                   foreach=True)
        else:
            raise ConfigError(f"optimizer must be adamw, sgd or sgd-momentum, got {optimizer!r}")
        trace.recording = False  # the first step makes the state (zeros): a later step's kernels are the step's
        step.step()
        trace.recording = True
        step.step()
    return tuple(trace.kernels)


LAYER_KEYS = ("n_layer", "num_hidden_layers")  # a config.json's depth: GPT-2's, and Llama's and its kin's


def depth(model: str) -> int | None:
    """The blocks of a decoder given as a config.json, or None (a preset, an encoder-decoder)."""
    import json
    from pathlib import Path

    if not Path(model).is_file():
        return None
    try:
        config = json.loads(Path(model).read_text())
    except (OSError, ValueError):
        return None
    return next((config[k] for k in LAYER_KEYS if isinstance(config.get(k), int)), None)


@lru_cache(maxsize=64)
def shallower(model: str, layers: int) -> str:
    """The config.json `model` with `layers` blocks, written beside the others of its kind in a temporary
    folder: its kernels are the same but for the blocks', which repeat (a deep model is priced from one and two)."""
    import hashlib
    import json
    import tempfile
    from pathlib import Path

    config = json.loads(Path(model).read_text())
    for key in LAYER_KEYS:
        if key in config:
            config[key] = layers
    text = json.dumps(config, sort_keys=True)
    folder = Path(tempfile.gettempdir()) / "multigpu-shallower"
    folder.mkdir(exist_ok=True)
    path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        path.write_text(text)
    return str(path)


def kernel_seconds(kernel: Kernel, compute) -> float:
    """The GPU's time for `kernel` on `compute` (`rates.Compute`): a product or attention at the rate the sweep
    reached at its size, anything else its bytes over the bandwidth."""
    if kernel.kind == "memory":
        return kernel.bytes / compute.bandwidth
    return kernel.flops / compute.product_rate(kernel.dtype, kernel.size)


def timeline(kernels, compute, start: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(host, GPU) clocks after `kernels` run from `start`: the host issues each kernel `compute.launch_s` after
    the last; the GPU runs it once it is issued and the one before has ended."""
    host, gpu = start
    for k in kernels:
        host += compute.launch_s * k.launches
        gpu = max(host, gpu) + kernel_seconds(k, compute)
    return host, gpu


@dataclass(frozen=True)
class StepKernels:
    """A step's kernels priced: `seconds` (the step, the two clocks walked), `busy` (the GPU's own time, by
    phase and kind: {"forward": {"product": s, "attention": s, "memory": s}, ...}), `launches`."""

    seconds: float
    busy: dict
    launches: int

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "gpu_busy_s": self.busy, "kernels": self.launches}


def step_seconds(compute, model: str, micro_batch: int, seq_len: int, dtype: str = "fp32",
                 activation_checkpointing: bool | str = False, optimizer: str = "adamw",
                 micro_batches: int = 1) -> StepKernels:
    """One training step on one GPU of `compute`: `micro_batches` forwards and backwards of `micro_batch`
    samples (each after the first adds its gradients to the last's: a read of both and a write, per
    weight), then the optimizer's step."""
    kernels = step_kernels(model, micro_batch, seq_len, dtype, activation_checkpointing, optimizer)
    passes = [k for k in kernels if k.phase != "optimizer"]
    tail = [k for k in kernels if k.phase == "optimizer"]
    if micro_batches > 1:
        from multigpu.estimator.model_trace import model_shape

        grads = model_shape(model).parameters * (2 if dtype == "bf16-master" else 4)
        passes = passes + [Kernel("_foreach_add_", "memory", "backward", bytes=3.0 * grads,
                                  launches=max(1, math.ceil(grads / 4 / FOREACH_CHUNK / FOREACH_CHUNKS_PER_LAUNCH)))]
    first = passes[:len(passes) - 1] if micro_batches > 1 else passes  # the first adds no gradients to others
    clocks = timeline(first, compute)
    if micro_batches > 1:  # each later micro-batch takes the time of the second
        second = timeline(passes, compute, clocks)
        clocks = tuple(b + (micro_batches - 2) * (b - a) for a, b in zip(clocks, second))
    clocks = timeline(tail, compute, clocks)
    busy: dict = {}
    for k in kernels:
        phase = busy.setdefault(k.phase, {})
        scale = micro_batches if k.phase != "optimizer" else 1
        phase[k.kind] = phase.get(k.kind, 0.0) + scale * kernel_seconds(k, compute)
    launches = micro_batches * sum(k.launches for k in passes) + sum(k.launches for k in tail)
    return StepKernels(max(clocks), busy, launches)
