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
from multigpu.memory import CATEGORIES


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
                      largest_tensor=max(p.numel() for p in params), vocab_size=vocab, family=family)


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


# -- the peak of one training step, per rank ---------------------------------------------------

ESTIMATED = ("single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp")
# fp32; bf16-mixed as this package runs it (autocast: fp32 parameters, gradients and optimizer
# state, bf16 compute); bf16-master as the ZeRO paper and DeepSpeed count mixed precision (bf16
# parameters and gradients, an fp32 master copy of the weights in the optimizer state)
ESTIMATOR_DTYPES = ("fp32", "bf16-mixed", "bf16-master")
GPUS = {  # name -> the memory its name says, read as GiB; the usable amount is a little less on some cards,
    # so give --gpu-memory where it matters
    "v100-16gb": 16 * 2**30, "v100-32gb": 32 * 2**30, "a10-24gb": 24 * 2**30, "a100-40gb": 40 * 2**30,
    "a100-80gb": 80 * 2**30, "l4-24gb": 24 * 2**30, "l40s-48gb": 48 * 2**30, "h100-80gb": 80 * 2**30,
    "h200-141gb": 141 * 2**30, "rtx4090-24gb": 24 * 2**30,
}


@dataclass(frozen=True)
class Setup:
    """One question: this model, this strategy, this many ranks, this batch."""

    model: str
    strategy: str = "ddp"
    world_size: int = 1
    seq_len: int = 256
    target_len: int | None = None  # encoder-decoder: the decoder's length (default: seq_len)
    dtype: str = "fp32"
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    grad_accum_steps: int = 1
    reshard_after_forward: bool = True  # fsdp: False keeps the gathered units from forward to backward
    offload_optimizer: bool = False  # ZeRO-Offload: the optimizer state and step live in host memory
    bucket_cap_mb: float = 25.0
    cuda_context_bytes: int = 0  # what the CUDA context takes on each GPU (0 on CPU)
    backend: str = "nccl"  # "gloo" (CPU): its reduce-scatter works on a copy of the whole input


@dataclass
class Estimate:
    setup: Setup
    global_batch: int | None
    per_rank_batch: int | None  # samples per rank per micro-batch (dp: per replica)
    per_rank_bytes: dict  # CATEGORIES and "total", at the estimated peak
    phase: str  # where the peak falls: "forward" (end of forward), "backward" or "model states only"
    method: str

    def as_dict(self) -> dict:
        return {"setup": asdict(self.setup), "global_batch": self.global_batch, "batch_size": self.global_batch,
                "per_rank_batch": self.per_rank_batch, "per_rank_bytes": self.per_rank_bytes,
                "phase": self.phase, "method": self.method}


def model_states(setup: Setup) -> dict[str, int]:
    """Parameters, gradients and optimizer state each rank keeps between steps (the ZeRO
    formulas: `multigpu.memory.zero_model_states`)."""
    from multigpu.config import ZERO_STAGE
    from multigpu.memory import zero_model_states

    shape = model_shape(setup.model)
    stage = ZERO_STAGE[setup.strategy]
    accounting = "bf16-mixed" if setup.dtype == "bf16-master" else "fp32"  # memory.zero_model_states' names
    states = zero_model_states(shape.parameters, setup.world_size if stage else 1, stage, setup.optimizer, accounting)
    states = {k: math.ceil(v) for k, v in states.items()}
    if setup.offload_optimizer:
        states["optimizer"] = 0
    return states


def estimate(setup: Setup, global_batch: int | None = None) -> Estimate:
    """Per-rank bytes at the peak of one training step (`global_batch` samples over all
    ranks), or the model states alone when `global_batch` is None."""
    _check(setup)
    states = model_states(setup)
    if global_batch is None:
        per_rank = {**states, "activations": 0, "other": setup.cuda_context_bytes}
        per_rank["total"] = sum(per_rank.values())
        return Estimate(setup, None, None, per_rank, "model states only",
                        "ZeRO formulas for the model states; no batch, no activations")
    b = _per_rank_batch(setup, global_batch)
    phases = _phases(setup, states, b)
    phase = max(phases, key=lambda name: sum(phases[name].values()))
    per_rank = {k: int(phases[phase][k]) for k in CATEGORIES}
    per_rank["other"] += setup.cuda_context_bytes
    per_rank["total"] = sum(per_rank.values())
    return Estimate(setup, global_batch, b, per_rank, phase,
                    "ZeRO formulas for the model states; activations traced once on fake tensors "
                    "(batch 1 and 2) and scaled linearly; the peak from the step's phases")


def _check(setup: Setup) -> None:
    from multigpu.config import OPTIMIZERS

    if setup.strategy not in ESTIMATED:
        raise ConfigError(f"the estimator knows the strategies {', '.join(ESTIMATED)}; got {setup.strategy!r}")
    if setup.dtype not in ESTIMATOR_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(ESTIMATOR_DTYPES)}, got {setup.dtype!r}")
    if setup.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {setup.optimizer!r}")
    if not isinstance(setup.world_size, int) or setup.world_size < 1:
        raise ConfigError(f"world size must be a whole number of at least 1, got {setup.world_size!r}")
    if setup.strategy == "single" and setup.world_size != 1:
        raise ConfigError("strategy single runs on one device: use --world-size 1")
    if setup.seq_len < 1 or (setup.target_len is not None and setup.target_len < 1):
        raise ConfigError("sequence lengths must be at least 1")
    if setup.grad_accum_steps < 1:
        raise ConfigError(f"gradient accumulation steps must be at least 1, got {setup.grad_accum_steps}")
    if setup.offload_optimizer and setup.strategy not in ("zero1", "zero2", "zero3"):
        raise ConfigError("optimizer offload (ZeRO-Offload) goes with a ZeRO stage: zero1, zero2 or zero3")


def _per_rank_batch(setup: Setup, global_batch: int) -> int:
    per_step = setup.world_size * setup.grad_accum_steps
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % per_step:
        raise ConfigError(f"the global batch ({global_batch!r}) must be a positive multiple of world size x "
                          f"accumulation steps ({setup.world_size} x {setup.grad_accum_steps} = {per_step})")
    return global_batch // per_step


def _phases(setup: Setup, states: dict, b: int) -> dict[str, dict[str, float]]:
    """What a rank holds, by category, at the moments one of which is the peak:
    - "forward": the end of forward, every saved activation alive, the loss's gradient made;
    - "backward, head done": the head's activations freed, its gradient in hand (ZeRO-2's
      first bucket is allocated now);
    - "backward, last block done": the last block's activations freed too, its whole
      gradient made and about to be reduce-scattered (ZeRO-3, FSDP);
    - "backward": the end of backward, every gradient made, the largest being summed."""
    shape = model_shape(setup.model)
    width = 2 if setup.dtype == "bf16-master" else 4  # bytes of a parameter, and of its gradient
    psi, n, s = shape.parameters * width, setup.world_size, setup.strategy
    # how the layers compute: this package's bf16-mixed is autocast, and FSDP's mixed-precision
    # policy also gathers bf16 weights; bf16-master keeps bf16 weights and no autocast
    bf16_weights = setup.dtype == "bf16-master" or (setup.dtype == "bf16-mixed" and s == "fsdp")
    compute = {"weights": "bf16" if bf16_weights else "fp32", "autocast": setup.dtype == "bf16-mixed"}
    cost = activation_cost(setup.model, setup.seq_len, setup.target_len, **compute,
                           checkpointing=setup.activation_checkpointing)
    # T5's logits are freed before backward
    saved = cost.saved(b) - (cost.logits_per_sample * b if shape.family == "t5" else 0)
    tail, last_block = cost.freed_first(b)
    loss = 2 * cost.logits_per_sample * b  # the loss's gradient: log-probabilities and logits
    biggest = shape.largest_tensor * width  # the embedding (GPT ties it to the head)
    shard = math.ceil(psi / n)
    unit_width = 2 if bf16_weights else width  # FSDP's mixed-precision policy gathers bf16 copies
    root, block = shape.outside_blocks * unit_width, shape.largest_block * unit_width
    p, g, o = states["params"], states["grads"], states["optimizer"]
    accumulating = setup.grad_accum_steps > 1
    fwd = {"params": p, "grads": 0, "optimizer": o, "activations": saved, "other": loss}
    bwd = {"params": p, "grads": g - biggest, "optimizer": o, "activations": 0, "other": 3 * biggest}
    phases = {"forward": fwd, "backward": bwd}
    if s in ("single", "dp", "ddp"):
        fwd["grads"] = psi if accumulating else 0
    if s == "ddp":  # the reducer's buckets: a copy of every gradient
        fwd["other"] += psi
        bwd["other"] += psi
    if s == "dp":  # the primary replica: every replica's outputs and the whole batch's loss come to it
        fwd["grads"] = psi  # the replicas' gradients are reduced into the primary's
        fwd["activations"] += (n - 1) * cost.logits_per_sample * b
        fwd["other"] = 2 * cost.logits_per_sample * b * n + loss
    if s == "zero1":  # one flat gradient buffer, kept; reduce-scattered once backward is done
        fwd["grads"] = bwd["grads"] = psi
        phases["reduce-scatter"] = {"params": p, "grads": psi, "optimizer": o, "activations": 0,
                                    "other": shard + (psi if setup.backend == "gloo" else 0)}
    if s == "zero2":  # the gradient shard; a bucket fills once the head's backward is done
        # a bucket holds up to the cap and a shard, but never splits a parameter
        bucket = max(min(setup.bucket_cap_mb * 2**20, shard), biggest)
        fwd["grads"] = g
        phases["backward, head done"] = {**fwd, "activations": saved - tail, "other": loss + bucket}
        bwd.update(grads=g, other=bucket + 3 * biggest)
    if s == "zero3" or s == "fsdp":
        fsdp = s == "fsdp"
        everything = shape.parameters * unit_width
        # at the end of forward the last block is resharded (unless FSDP keeps every unit) and
        # only the root stays gathered; FSDP2 leaves that block's all-gather buffer alive; FSDP's
        # gradients are None between steps, ours (zero3) are kept shards
        gathered = everything if (fsdp and not setup.reshard_after_forward) else root
        fwd.update(params=p + gathered, grads=0 if fsdp else g, activations=saved + (block if fsdp else 0))
        gathered_block = {"params": p + root + block, "optimizer": o}
        if not fsdp:  # ours, after the last block's backward: the copy reduce-scatter sends and what it
            # returns; the head's (tied) weight gradient waits in the root unit
            phases["backward, last block done"] = {
                **gathered_block, "grads": g, "activations": saved - tail - last_block,
                "other": 2 * block + math.ceil(block / n) + biggest}
        elif setup.reshard_after_forward:  # FSDP2, measured module by module: the peak falls inside
            # the last block's backward (gathered again, its gradients being made, its activations
            # not yet freed) or inside the next block's (the last one's gradient reduce-scattered
            # to a shard, its unsharded copy not yet released)
            phases["backward, in the last block"] = {
                **gathered_block, "grads": 0, "activations": saved - tail, "other": loss + block}
            phases["backward, in the block before"] = {
                **gathered_block, "grads": math.ceil(shape.largest_block * width / n),
                "activations": saved - tail - last_block, "other": loss + 2 * block}
        # the blocks are done and resharded; the root's (embedding's) gradient is being summed
        bwd.update(params=p + root, grads=g, other=3 * biggest)
    if setup.activation_checkpointing:  # backward recomputes one block at a time
        full = activation_cost(setup.model, setup.seq_len, setup.target_len, **compute)
        per_block = (full.saved(b) - cost.saved(b)) / max(1, shape.blocks)
        bwd["activations"] += per_block
    return phases


def largest_batch(setup: Setup, memory_bytes: int) -> Estimate | None:
    """The estimate for the largest global batch whose peak fits in `memory_bytes` per rank
    (global batches step by world size x accumulation steps), or None if not even the
    smallest fits. The peak grows with the batch, so a doubling search then a bisection
    find it in a few dozen evaluations of the formulas."""
    step = setup.world_size * setup.grad_accum_steps

    def fits(k: int) -> bool:
        return estimate(setup, k * step).per_rank_bytes["total"] <= memory_bytes

    if not fits(1):
        return None
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            raise ConfigError(f"more than {lo:,} samples per rank fit in {memory_bytes / 2**30:,.0f} GiB; "
                              "give the memory of one device (e.g. --gpu-memory 80GiB), not a total")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return estimate(setup, lo * step)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, allow_zero: bool = False) -> int:
    """'32GiB' -> 34359738368; '80GB' -> 80e9; decimal and binary units, case-insensitive."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if not found or unit not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as an amount of memory; write e.g. 32GiB, 80GB or 512MiB")
    value = float(found.group(1)) * _UNITS[unit]
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"memory must be {'zero or more' if allow_zero else 'positive'}, got {text!r}")
    return int(value)


# -- against measurement ------------------------------------------------------------------------

# a recorded strategy -> the estimator's (the from-scratch and library versions of one idea)
_AS_ESTIMATED = {"single": "single", "dp": "dp", "ddp": "ddp", "ddp-scratch": "ddp", "zero1": "zero1",
                 "zero2": "zero2", "zero3": "zero3", "fsdp": "fsdp"}  # FSDP1's flat parameters: not modelled


def measured_categories(record: dict, rank: int = 0) -> dict[str, int]:
    """A record's peak on `rank`, by category. Parameters, gradients and optimizer state as
    the tracker classified them; activations are the saved activations, or fewer if some
    were already freed at the peak (the tracker also files buffers that forward creates,
    such as DDP's buckets, under activations); other is the rest of the peak."""
    peak = record["peak_memory_bytes_by_rank"][rank]
    out = {k: peak[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = min(record["saved_activation_bytes_by_rank"][rank], peak["activations"])
    out["other"] = peak["total"] - sum(out.values())
    out["total"] = peak["total"]
    return out


def setup_of(record: dict) -> Setup | None:
    """The estimator's question for a recorded run, or None for a strategy it does not model."""
    c = record["config"]
    if c["strategy"] not in _AS_ESTIMATED or c["extra"].get("wrap", "blocks") != "blocks":
        return None
    return Setup(model=c["model"], strategy=_AS_ESTIMATED[c["strategy"]], world_size=c["world_size"],
                 seq_len=c["seq_len"], dtype=c["dtype"], optimizer=c["optimizer"],
                 activation_checkpointing=c["activation_checkpointing"], grad_accum_steps=c["grad_accum_steps"],
                 reshard_after_forward=c["extra"].get("reshard_after_forward", True),
                 bucket_cap_mb=c["bucket_cap_mb"], backend=record["provenance"]["backend"])


def categories_off(row: dict) -> list[str]:
    """The categories of an `against_records` row whose estimate is off by more than 10% of
    the measured category and more than 5% of the measured peak (a few MiB move between
    categories with the allocator's timing)."""
    est, meas = row["estimated"], row["measured"]
    return [c for c in CATEGORIES if abs(est[c] - meas[c]) > max(0.10 * meas[c], 0.05 * meas["total"])]


def against_records(records: list[dict]) -> list[dict]:
    """One row per recorded run the estimator models: estimated and measured bytes by
    category (rank 0; the DP primary), and the relative error of the total."""
    rows = []
    for r in records:
        setup = setup_of(r)
        if setup is None or not (r.get("peak_memory_bytes_by_rank") or [{}])[0].get("total"):
            continue  # a strategy the estimator does not model, or a run that did not track memory
        found = estimate(setup, r["config"]["global_batch_size"])
        est, meas = found.per_rank_bytes, measured_categories(r)
        rows.append({"experiment": r.get("experiment"), "strategy": r["config"]["strategy"],
                     "variant": "no reshard" if not setup.reshard_after_forward else "",
                     "world_size": r["config"]["world_size"], "global_batch": r["config"]["global_batch_size"],
                     "estimated": est, "measured": meas, "total_error": est["total"] / meas["total"] - 1,
                     "phase": found.phase})
    return rows
