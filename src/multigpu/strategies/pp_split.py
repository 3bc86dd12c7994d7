"""Cutting the GPT into pipeline stages, and what the stages must then agree on.

Every pipeline strategy (from scratch or the library's) starts here:

- `stage_blocks`: which blocks a stage owns. Contiguous runs, as even as the count allows;
  the first stages take the extra blocks (picotron does the same; torchtitan also counts
  the embedding and the head as one block each, a refinement we leave to the reader).
- `split_gpt`: the whole model is built on every rank from the same seed, then each stage
  deletes what it does not own (torchtitan's manual split). Initial weights therefore equal
  the single device's, and every parameter keeps its name (`blocks.5.mlp.fc.weight`).
- A tied head: GPT-2's head reuses the token embedding, which lives on the first stage while
  the head lives on the last. Both keep a copy, and after backward the two gradients are
  summed between the two stages (Megatron's "embedding group"), so both copies take the
  same step: `sync_tied_embedding`.
- The loss is known on the last stage only: `loss_to_all` sends it to the others, so every
  rank records the same loss (`state.pipeline_state_dict` puts the stages' weights back
  together).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from multigpu.models import GPT
from multigpu.strategies import host_value


def deep_enough(model: str, stages: int) -> str | None:
    """The smallest of the package's small GPT presets (gpt-tiny, gpt-mini, gpt-small: the
    laptop's sizes, not GPT-2's) with a block for each of `stages` stages, where `model` is
    one of them with fewer blocks; None where it has enough, or none of them is deep enough."""
    from multigpu.models import GPT_SIZES

    small = sorted((c.n_layer, name) for name, c in GPT_SIZES.items() if name.startswith("gpt-"))
    if model not in dict((n, k) for k, n in small) or GPT_SIZES[model].n_layer >= stages:
        return None
    return next((name for n_layer, name in small if n_layer >= stages), None)


def deeper_preset(stages: int) -> str:
    """', e.g. --model gpt2 (12 blocks)': the smallest GPT preset with a block for each stage, for a
    refusal to name the one flag to add."""
    from multigpu.models import GPT_SIZES

    found = min(((c.n_layer, name) for name, c in GPT_SIZES.items() if c.n_layer >= stages), default=None)
    return f", e.g. --model {found[1]} ({found[0]} blocks)" if found else ""


def stage_blocks(n_layer: int, num_stages: int, stage: int) -> list[int]:
    """The indices of the blocks stage `stage` of `num_stages` owns: contiguous, the first
    `n_layer % num_stages` stages one more."""
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"{num_stages} pipeline stages cannot split {n_layer} blocks: "
                         f"use at most {n_layer} stages, one block each")
    per, extra = divmod(n_layer, num_stages)
    start = stage * per + min(stage, extra)
    return list(range(start, start + per + (stage < extra)))


def split_gpt(model: GPT, stage: int, num_stages: int) -> GPT:
    """Delete, in place, what stage `stage` does not own: other stages' blocks; the
    embeddings unless first; the final norm and the head unless last. Returns the model,
    whose forward then takes token ids (first stage) or hidden states (later stages) and
    returns hidden states (earlier stages) or the loss/logits (last stage)."""
    if not isinstance(model, GPT):
        raise ValueError(f"the pipeline strategies cut the package's GPT, not {type(model).__name__}")
    mine = {str(i) for i in stage_blocks(model.cfg.n_layer, num_stages, stage)}
    for name in [n for n in model.blocks if n not in mine]:
        del model.blocks[name]
    if stage > 0:
        model.wte = model.wpe = None
    if stage < num_stages - 1:
        model.ln_f = model.lm_head = None
    return model


def is_tied(model: GPT) -> bool:
    return bool(model.cfg.tie_embeddings)


def tied_embedding_group(grid):
    """The group of this pipeline's first and last stage (same data- and tensor-parallel
    coordinates), which each hold a copy of a tied embedding. Every rank must call this, in
    the same order (creating groups is collective); None if there is one stage."""
    pp = grid.size("pp")
    if pp == 1:
        return None
    stride = grid.size("dp") * grid.size("cp") * grid.size("tp")  # ranks between consecutive stages of a pipeline
    mine = None
    for base in range(stride):  # one group per pipeline; this rank joins its own
        group = dist.new_group([base, base + (pp - 1) * stride])
        if grid.rank % stride == base:
            mine = group
    return mine


def sync_tied_embedding(model: GPT, group, stage: int, num_stages: int) -> None:
    """Sum the tied weight's gradient between the first stage (embedding) and the last
    (head): each computed only its own use's share. Call after backward, before the step."""
    if group is None or not is_tied(model) or stage not in (0, num_stages - 1):
        return
    weight = model.wte.weight if stage == 0 else model.lm_head.weight
    dist.all_reduce(local_grad(weight), group=group)


def local_grad(weight: torch.Tensor) -> torch.Tensor:
    """The part of `weight`'s gradient this rank holds, as a plain tensor that aliases it
    (made zero if backward left none). Under TP and FSDP a weight is a DTensor, and so is
    its gradient, but not always placed like the weight (the vocabulary-parallel
    embedding's comes back replicated): we place it like the weight, so that the two
    copies of a tied embedding, cut alike, hold the same rows on the same rank."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != weight.placements:
        weight.grad = grad = grad.redistribute(weight.device_mesh, weight.placements)
    return grad.to_local()


def loss_to_all(loss: float | torch.Tensor, grid, device: torch.device, src: int | None = None) -> float:
    """The last stage's loss, on every stage of the pipeline (each records the same). `src`:
    the pipeline rank holding the last stage (default the last rank; under a V placement of
    two stages per rank it is rank 0). `loss` may stay a tensor on the device until here: it
    is read once, after the broadcast. The broadcast's tensor lives on the rank's `device`:
    NCCL has no CPU tensors (a CPU tensor there raises "No backend type associated with
    device type cpu")."""
    pp = grid.size("pp")
    value = torch.as_tensor(loss, dtype=torch.float64, device=device).reshape(1)
    if pp > 1:
        dist.broadcast(value, group=grid.group("pp"), group_src=pp - 1 if src is None else src)
    return host_value(value)
