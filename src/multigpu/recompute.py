"""Activation recomputation: what a checkpointed block keeps for backward, and what it runs again.

- **full** (`activation_checkpointing=True` or "full"): a block keeps its input alone and runs its
  whole forward again in backward (torch's non-reentrant checkpoint, as `checkpoint_wrapper` applies
  it; it stops once backward has what it needs, so the block's last product is not run again).
- **selective** ("selective"): torch's per-operation policy (`torch.utils.checkpoint`'s
  `create_selective_checkpoint_contexts`). A block keeps the outputs of the operations that are
  costly to run again (its matrix products, fused attention, the functional collectives'
  results) and recomputes the cheap rest: LayerNorms, GELU, residual sums, views. Except one kind
  of product: the output projections (attention's and the MLP's, whose output only joins the
  residual sum), which it runs again. Their outputs would be kept for nothing but the residual
  stream, which the next LayerNorm keeps anyway, and under tensor parallelism they are whole-size
  partial sums. torchtitan's "op" mode counts instead: it keeps every matrix product but every
  second one of a block (torchtitan/distributed/activation_checkpoint.py, "Save all compute/comm ops,
  except every second mm/linear"). In a GPT-2 block (qkv, out, fc, proj) those are the output
  projections, the same choice; in a Llama block (q, k, v, o, w1, w3, w2) they are k, o and w3. Here
  the projections are named (`OUTPUT_PROJECTIONS`), so the FLOPs it runs again can be counted from
  the modules (`estimator.flops`): each block's projections but its last, which torch's early stop
  never reaches.

Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198) call "selective" the converse choice:
keep everything but attention's scores, the one part that grows with the square of the sequence.
Fused attention (`scaled_dot_product_attention`) already keeps no scores, recomputing them in its
backward: for the package's GPT that choice is made in the kernel, and the policy here takes the next
cheapest bytes.
"""

from __future__ import annotations

import functools
import threading

import torch

from multigpu.errors import ConfigError

MODES = ("full", "selective")  # what `activation_checkpointing` may name besides True (full) and False (none)
# why DeepSpeed's ZeRO-3 refuses selective recomputation (strategies.deepspeed.config_problems, and here)
LINEAR_IN_PLACE = ("DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear with its own function, which adds the "
                   "bias onto the product's output in place; selective recomputation keeps that output, so its "
                   "recompute would add the bias twice")


def recompute_mode(value) -> str | None:
    """`activation_checkpointing`'s value as a mode: None (keep everything), "full" or "selective"."""
    if value is False or value is None:
        return None
    if value is True:
        return "full"
    if value in MODES:
        return value
    raise ConfigError(f"activation_checkpointing must be False, True (full), 'full' or 'selective', got {value!r}")


@functools.cache
def saved_operations() -> frozenset:
    """The operations whose outputs selective recomputation keeps: matrix products and fused attention
    (whichever of its kernels the device runs), and the functional collectives' results, whose
    recomputation would repeat a communication."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    for n in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "wait_tensor"):
        if functional is not None and hasattr(functional, n):
            saved.add(getattr(functional, n).default)
    return frozenset(saved)


# the last name of an output projection's module: the package's GPT (attn.proj, mlp.proj), T5 (o, wo),
# Llama and its kin (o_proj, down_proj), GPT-2 (c_proj)
OUTPUT_PROJECTIONS = ("proj", "o", "wo", "o_proj", "down_proj", "c_proj")
_inside = threading.local()  # how many output projections this thread is inside (forward or recompute)


def is_output_projection(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS


def mark_output_projections(model: torch.nn.Module) -> None:
    """Hooks on each output projection that tell the policy when its operations run."""
    def enter(*_):
        _inside.depth = getattr(_inside, "depth", 0) + 1

    def leave(*_):
        _inside.depth -= 1

    for name, module in model.named_modules():
        if is_output_projection(name, module):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, always_call=True)  # also when a recompute stops early inside it


def _collective(func) -> bool:
    return getattr(func, "namespace", "") == "_c10d_functional"


def _policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = func in saved_operations() and (_collective(func) or not getattr(_inside, "depth", 0))
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)  # a fresh pair per call, as torch asks


def checkpoint_wrapper_fn(mode: str):
    """The wrapper `apply_activation_checkpointing` puts around each block for `mode`."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "full":
        return checkpoint_wrapper
    if mode == "selective":
        if "deepspeed" in getattr(torch.nn.functional.linear, "__module__", ""):
            raise ConfigError(LINEAR_IN_PLACE + " (it is replaced in this process): use full recomputation")
        return functools.partial(checkpoint_wrapper, context_fn=_selective_context)
    raise ConfigError(f"no recomputation mode {mode!r}: choose one of {', '.join(MODES)}")
