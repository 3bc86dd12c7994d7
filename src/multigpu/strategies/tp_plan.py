"""Tensor parallelism with PyTorch's library (`torch.distributed.tensor.parallel`): the plan.

This is step 2 of the order in `compose.py`, which every library composition goes through
(`tp`, `fsdp --tp`, the pipelines with `--tp`); the `tp` strategy itself is `tp.py`.

Megatron-LM's split of a transformer block (Shoeybi et al. 2019,
https://arxiv.org/abs/1909.08053): the first linear layer of each pair is cut by its output
features (`ColwiseParallel`: rank r computes heads r*H/tp ..., or a slice of the MLP's
hidden units), the second by its input features (`RowwiseParallel`: each rank's partial
product, then one all-reduce). The pair needs no communication in between, so a block
costs one all-reduce per sublayer in forward and one in backward. Every weight becomes a
DTensor: a `torch.Tensor` subclass that knows its mesh and placement (`Shard(0)`,
`Replicate()`, ...), and whose operations insert the collectives themselves.

Three options on top of that:
- the vocabulary is cut too: the token embedding by rows (`RowwiseParallel` of an
  embedding masks the ids other ranks own, then sums), the head by output features, so
  the logits come out sharded over the vocabulary;
- `loss_parallel` (default on): cross-entropy on vocabulary-sharded logits, with three
  small all-reduces (max, sum of exponentials, target logit) instead of gathering
  (batch, seq, vocab) logits on every rank. Forward and backward both run inside
  `torch.distributed.tensor.parallel.loss_parallel()`;
- `sequence_parallel` (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198): between
  the sublayers, where every rank would hold the same (batch, seq, d) activations, each
  rank keeps only its slice of the sequence. The all-reduce becomes a reduce-scatter
  (into the slice) and an all-gather (before the next sublayer): the same bytes, and
  LayerNorm and the residual stream hold 1/tp of the activations.

Options (RunConfig.extra, read by `compose.parallelize`): `sequence_parallel` (default
False), `loss_parallel` (default True). The plan is torchtitan's classic `apply_tp`
(pytorch/torchtitan at 42b0beb, torchtitan/models/llama3/infra/parallelize.py). For a
Hugging Face model we use the `base_model_tp_plan` its config ships with.
"""

from __future__ import annotations

import fnmatch
from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from multigpu.models import GPT, CausalSelfAttention, split_problems

WRAPPED = "_checkpoint_wrapped_module."  # what activation checkpointing adds to module paths


def _require_divides(tp: int, count: int, what: str) -> None:
    for problem in split_problems(tp, count, what):
        raise ValueError(problem)


def concrete_plan(root: nn.Module, patterns: dict[str, object]) -> dict[str, object]:
    """Plan keys with wildcards ("layers.*.self_attn.q_proj") -> the modules' real paths.

    A checkpointed block hides its children one level down
    (`blocks.0._checkpoint_wrapped_module.attn.q`); we match each module's path with that
    level removed, so one plan serves the model with and without checkpointing."""
    plan, found = {}, set()
    for name, _ in root.named_modules():
        plain = name.replace(WRAPPED, "")
        for pattern, style in patterns.items():
            # fnmatch's "*" also matches dots: ask for as many path levels as the pattern has
            if fnmatch.fnmatchcase(plain, pattern) and pattern.count(".") == plain.count("."):
                plan[name] = style
                found.add(pattern)
    missing = [p for p in patterns if p not in found]
    if missing:
        raise ValueError(f"the tensor-parallel plan names modules this model does not have: {missing}")
    return plan


# -- the package's GPT -------------------------------------------------------------------

class QKV(nn.Module):
    """Attention's fused [queries | keys | values] projection as three linear layers, which
    ColwiseParallel can cut each by heads (cut as one, rank 0 would get all the queries and
    half the keys). Its output is [q | k | v] of the heads this rank holds, the layout the
    attention splits in three. The from-scratch version cuts the fused weight by thirds
    instead (tp_scratch.ColumnParallelLinear's `parts`)."""

    def __init__(self, fused: nn.Linear):
        super().__init__()
        width = fused.out_features // 3
        for name, weight, bias in zip("qkv", fused.weight.detach().chunk(3), (
                fused.bias.detach().chunk(3) if fused.bias is not None else (None,) * 3)):
            layer = nn.Linear(fused.in_features, width, bias=bias is not None, device=weight.device)
            with torch.no_grad():
                layer.weight.copy_(weight)
                if bias is not None:
                    layer.bias.copy_(bias)
            setattr(self, name, layer)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def split_qkv(model: GPT) -> GPT:
    """Every attention's fused projection as a QKV, in place (the weights unchanged)."""
    for attention in [m for m in model.modules() if isinstance(m, CausalSelfAttention)]:
        if not isinstance(attention.qkv, QKV):
            attention.qkv = QKV(attention.qkv)
    return model


def gpt_plan(sequence_parallel: bool = False, loss_parallel: bool = True) -> dict[str, object]:
    """The plan for models.GPT, by module path ("blocks.*" is every block)."""
    # the residual stream between sublayers: whole on every rank, or cut along the sequence
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # vocabulary-parallel embedding: each rank looks up the ids in its rows, then sum
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        # each rank needs the positions of its own slice of the sequence only: the (seq, d)
        # lookup is reduce-scattered along dim 0, the sequence
        **({"wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))}
           if sequence_parallel else {}),
        # gather the input once per sublayer (SP), or all-reduce its gradient once in
        # backward for q, k and v together (Megatron's "f")
        "blocks.*.attn": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.qkv.q": ColwiseParallel(),  # the fused projection, as three (see QKV)
        "blocks.*.attn.qkv.k": ColwiseParallel(),
        "blocks.*.attn.qkv.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=stream),  # all-reduce or reduce-scatter
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=stream),
        # logits sharded over the vocabulary for loss_parallel, else gathered on every rank
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:  # LayerNorm works token by token: each rank normalizes its own slice
        plan.update({"blocks.*.ln_1": SequenceParallel(), "blocks.*.ln_2": SequenceParallel(),
                     "ln_f": SequenceParallel()})
    return plan


def parallelize_gpt(model: GPT, tp_mesh, sequence_parallel: bool = False, loss_parallel: bool = True) -> GPT:
    """Apply `gpt_plan` to a whole GPT (with or without activation checkpointing), in place.

    A tied head and embedding share one (vocab, d) weight; both styles cut it by rows
    (dim 0), but each makes its own DTensor parameter, so we tie them again after."""
    cfg, tp = model.cfg, tp_mesh.size()
    # a pipeline stage's piece lacks the modules other stages own (the embeddings, the head):
    # only the plan's entries for the modules it has apply
    present = {name for name, _ in model.named_children()}
    plan = {k: v for k, v in gpt_plan(sequence_parallel, loss_parallel).items() if k.split(".")[0] in present}
    _require_divides(tp, cfg.n_head, "attention heads")
    _require_divides(tp, cfg.d_ff, "MLP hidden units (d_ff)")
    _require_divides(tp, cfg.vocab_size, "vocabulary entries (the embedding and head are cut by token)")
    if sequence_parallel:
        _require_divides(tp, cfg.seq_len, "rows of the position table (sequence parallelism cuts it by position)")
    tied = model.lm_head is not None and model.wte is not None and model.lm_head.weight is model.wte.weight
    split_qkv(model)
    parallelize_module(model, tp_mesh, concrete_plan(model, plan))
    if tied:
        model.lm_head.weight = model.wte.weight  # same placement (Shard(0)), same local rows
    if sequence_parallel:
        def check_seq_len(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                _require_divides(tp, ids.shape[1], "tokens of the sequence (sequence parallelism cuts it)")
        model.register_forward_pre_hook(check_seq_len, with_kwargs=True)
    return model


# -- a Hugging Face causal LM --------------------------------------------------------------

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def hf_plan(config) -> dict[str, object]:
    """The config's own `base_model_tp_plan` ({"layers.*.self_attn.q_proj": "colwise", ...})
    as torch's styles, for the base model (`model.model`)."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"the {config.model_type!r} config has no base_model_tp_plan; "
                         "write a plan for it by hand (see gpt_plan)")
    unknown = {k: v for k, v in plan.items() if v not in STYLES}
    if unknown:
        raise ValueError(f"base_model_tp_plan uses styles this package does not map to torch's: {unknown}; "
                         f"known: {', '.join(STYLES)}")
    return {pattern: STYLES[style]() for pattern, style in plan.items()}


def parallelize_hf_causal_lm(model: nn.Module, tp_mesh, loss_parallel: bool = True) -> nn.Module:
    """The config's base_model_tp_plan on `model.model`, and the head cut by vocabulary, in
    place. The attention layers reshape with `view(..., -1, head_dim)`, so they work on the
    local heads. The base plan leaves the embedding whole; a head tied to it makes us cut
    the embedding by vocabulary too (as for the GPT) and tie them again."""
    config, tp = model.config, tp_mesh.size()
    _require_divides(tp, config.num_attention_heads, "attention heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    _require_divides(tp, kv_heads, "key/value heads (grouped-query attention)")
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate:
        _require_divides(tp, intermediate, "MLP hidden units (intermediate_size)")
    _require_divides(tp, config.vocab_size, "vocabulary entries (the head is cut by token)")
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embedding.weight
    parallelize_module(model.model, tp_mesh, concrete_plan(model.model, hf_plan(config)))
    if tied:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    parallelize_module(head, tp_mesh, ColwiseParallel(
        output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel))
    if tied:
        head.weight = embedding.weight
    return model


# -- what compose calls --------------------------------------------------------------------

class LossModule(nn.Module):
    """forward(**batch) -> the loss, computed inside `loss_parallel()` when it is on.

    The loss comes back as a plain tensor: under loss_parallel cross-entropy returns a
    replicated DTensor, which the training loop need not know about."""

    def __init__(self, model: nn.Module, loss_fn, parallel_loss: bool):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.parallel_loss = parallel_loss

    def forward(self, **batch):
        with loss_parallel() if self.parallel_loss else nullcontext():
            loss = self.loss_fn(self.model, batch)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def backward(self, loss) -> None:  # the backward of the loss must be inside the context too
        with loss_parallel() if self.parallel_loss else nullcontext():
            loss.backward()


def parallelize(model: nn.Module, tp_mesh, sequence_parallel: bool = False, loss_parallel: bool = True) -> LossModule:
    """Tensor-parallel `model` in place; return the module that computes its loss."""
    if isinstance(model, GPT):
        parallelize_gpt(model, tp_mesh, sequence_parallel, loss_parallel)
        return LossModule(model, lambda m, batch: m(**batch), loss_parallel)
    if hasattr(getattr(model, "config", None), "base_model_tp_plan") and hasattr(model, "lm_head"):
        if sequence_parallel:
            raise ValueError("sequence_parallel is implemented for the package's GPT only; "
                             "use sequence_parallel=False for a Hugging Face model")
        from multigpu.hf import hf_loss

        parallelize_hf_causal_lm(model, tp_mesh, loss_parallel)
        return LossModule(model, hf_loss, loss_parallel)
    raise ValueError(f"tensor parallelism needs a plan for {type(model).__name__}; "
                     "it knows the package's GPT and Hugging Face causal LMs with a base_model_tp_plan")
