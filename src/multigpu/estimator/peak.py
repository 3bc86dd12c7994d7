"""Memory per rank at the peak of one training step, estimated before anything runs.

Two parts, derived differently:

- **Model states** (parameters, gradients, optimizer state) follow the ZeRO paper's formulas
  (`multigpu.memory.zero_model_states`), from the exact parameter count of the rank's share
  of the model (`multigpu.estimator.share`, counted on the meta device).
- **Activations** are *traced once* on fake tensors, at batch 1 and 2
  (`multigpu.estimator.model_trace.activation_cost`): a fixed part and a per-sample part, so
  every batch size after that is arithmetic: no candidate is traced.

What a step holds at its peak is then put together phase by phase (`_phases`, `estimate`);
under a pipeline, the estimate is that of the most loaded rank, which is what must fit.
`multigpu.estimator.accuracy` sets the estimates beside the records.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from multigpu.errors import ConfigError
from multigpu.estimator.model_trace import model_shape
from multigpu.estimator.question import (
    PIPELINES,
    Setup,
    _zero_stage,
    allocator_rounding_bytes,
    check_setup,
    data_parallel_kind,
    on_gpu,
)
from multigpu.estimator.share import RankShare, _traced, bf16_weights, rank_shares, sharded_elements
from multigpu.memory import CATEGORIES, zero_model_states


@dataclass
class Estimate:
    setup: Setup
    global_batch: int | None
    per_rank_batch: int | None  # samples per data-parallel rank per micro-batch (dp: per replica)
    per_rank_bytes: dict  # CATEGORIES and "total", at the estimated peak
    phase: str  # where the peak falls: "forward" (end of forward), "backward" or "model states only"
    method: str
    pipeline_rank: int | None = None  # under a pipeline: the rank (stage) whose peak this is, the highest
    tied: tuple = ()  # other moments' bytes by category that reach the same total (filed differently)

    def as_dict(self) -> dict:
        return {"setup": asdict(self.setup), "degrees": self.setup.grid.as_dict(),
                "global_batch": self.global_batch, "batch_size": self.global_batch,
                "per_rank_batch": self.per_rank_batch, "per_rank_bytes": self.per_rank_bytes, "phase": self.phase,
                "pipeline_rank": self.pipeline_rank, "method": self.method}


def model_states(setup: Setup, share: RankShare | None = None) -> dict[str, int]:
    """Parameters, gradients and optimizer state a rank keeps between steps (the ZeRO
    formulas: `multigpu.memory.zero_model_states`) of its share of the model (default: the
    most loaded pipeline rank's)."""
    if share is None:
        return max((model_states(setup, s) for s in rank_shares(setup)), key=lambda states: sum(states.values()))
    stage = _zero_stage(setup)
    accounting = "bf16-master" if setup.dtype == "bf16-master" else "fp32"  # autocast keeps fp32 weights
    padded = sharded_elements(setup, share)  # a rank's share with its padding, where the layout decides it
    n = setup.replicas if stage else 1
    states = zero_model_states(share.parameters if padded is None else padded * n, n, stage, setup.optimizer,
                               accounting)
    states = {k: math.ceil(v) for k, v in states.items()}
    if setup.offload_optimizer:
        states["optimizer"] = 0
    return states


def _cuda_overheads(setup: Setup) -> int:
    """What a GPU holds besides the step's tensors: the CUDA context, cuBLAS's workspaces and
    the allocator's rounding (each 0 on a CPU); counted under "other"."""
    return setup.cuda_context_bytes + setup.cuda_workspace_bytes + allocator_rounding_bytes(setup)


def estimate(setup: Setup, global_batch: int | None = None) -> Estimate:
    """Per-rank bytes at the peak of one training step (`global_batch` samples over all
    ranks), or the model states alone when `global_batch` is None; under a pipeline, the
    peak of the most loaded rank."""
    check_setup(setup)
    grid = setup.grid
    method = "ZeRO formulas for the model states"
    if grid.tp > 1 or grid.pp > 1:
        method += " of the rank's share (its stages' blocks, matrices cut by tp)"
    if global_batch is None:
        found = []
        for share in rank_shares(setup):
            per_rank = {**model_states(setup, share), "activations": 0, "other": _cuda_overheads(setup)}
            per_rank["total"] = sum(per_rank.values())
            found.append((per_rank["total"], share.pipeline_rank, per_rank))
        _, rank, per_rank = max(found, key=lambda f: f[0])
        return Estimate(setup, None, None, per_rank, "model states only", f"{method}; no batch, no activations",
                        rank)
    b = _per_rank_batch(setup, global_batch)
    if model_shape(setup.model).vocab_size is None:
        _traced(setup, False)  # says why: a bare parameter count has no activations
    found = []
    for share in rank_shares(setup):
        phases = _phases(setup, share, model_states(setup, share), b)
        by_phase = {}
        for name, held in phases.items():
            by_phase[name] = {k: int(held[k]) for k in CATEGORIES}
            by_phase[name]["other"] += _cuda_overheads(setup)
            by_phase[name]["total"] = sum(by_phase[name].values())
        phase = max(by_phase, key=lambda name: by_phase[name]["total"])
        # moments that hold as much (a CPU's Adam: the end of backward and the step hold the same
        # bytes, filed differently); the tracker reports whichever came first
        tied = tuple(held for name, held in by_phase.items() if name != phase
                     and held["total"] == by_phase[phase]["total"])
        found.append((by_phase[phase]["total"], share.pipeline_rank, phase, by_phase[phase], tied))
    _, rank, phase, per_rank, tied = max(found, key=lambda f: f[0])
    method += (f"; activations traced once on fake tensors (batch 1 and 2) and scaled linearly, kept as "
               f"{'CUDA' if setup.on_cuda else 'a CPU'} keeps them ({setup.attention} attention, "
               f"{'the model' + chr(39) + 's dropout' if setup.dropout else 'no dropout'})")
    if grid.tp > 1:
        method += ", cut by tp as Megatron cuts them (Korthikanti et al. 2022)"
    if grid.cp > 1:
        method += f", of a rank's {setup.rank_seq_len} tokens of each sequence (cp {grid.cp})"
    if grid.pp > 1:
        method += ", times the schedule's micro-batches in flight"
    return Estimate(setup, global_batch, b, per_rank, phase, f"{method}; the peak from the step's phases", rank,
                    tied)


def _per_rank_batch(setup: Setup, global_batch: int) -> int:
    """Samples per data-parallel rank per micro-batch."""
    dp, m = setup.grid.dp, setup.grad_accum_steps
    per_step = dp * m
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % per_step:
        over = "world size" if dp == setup.world_size else "data-parallel ranks"
        raise ConfigError(f"the global batch ({global_batch!r}) must be a positive multiple of {over} x "
                          f"{'micro-batches' if setup.strategy in PIPELINES else 'accumulation steps'} "
                          f"({dp} x {m} = {per_step})")
    return global_batch // per_step


STEP_PHASE = "optimizer step"  # the phase an optimizer's step temporaries make (none for SGD)


def forward_saved(setup: Setup, share: RankShare, b: int) -> float:
    """One micro-batch's activations at the end of its forward, as training keeps them: the trace's, less the
    logits a Hugging Face model hands back with its loss (T5's, a causal LM's), which training drops once the
    loss is computed; a causal LM's come out of autocast in its dtype (held against dry runs: estimator/held)."""
    cost, family = share.activations, model_shape(setup.model).family
    returned = cost.logits_per_sample * b if family in ("t5", "causal-lm") else 0
    if family == "causal-lm" and setup.dtype in ("bf16-mixed", "fp16-mixed"):
        returned /= 2
    return cost.saved(b) - returned


def _phases(setup: Setup, share: RankShare, states: dict, b: int) -> dict[str, dict[str, float]]:
    """What a rank holds, by category, at the moments one of which is the peak:
    - "forward": the end of forward, every saved activation alive (a pipeline's micro-batches
      in flight), the loss's gradient made;
    - "backward, head done": the head's activations freed, its gradient in hand (ZeRO-2's
      first bucket is allocated now);
    - "backward, last block done": the last block's activations freed too, its whole
      gradient made and about to be reduce-scattered (ZeRO-3, FSDP);
    - "backward, others in flight" (a pipeline): one micro-batch's backward done, every
      gradient of the stage made, the other micro-batches' activations still alive;
    - "backward": the end of backward, every gradient made, the largest being summed (an
      encoder-decoder: when the decoder's embedding is, the encoder's activations still alive);
    - "optimizer step" (Adam, AdamW): the step's temporaries beside every model state
      (optimizer_step_temporary)."""
    width = 2 if setup.dtype == "bf16-master" else 4  # bytes of a parameter, and of its gradient
    psi, n, s = share.parameters * width, setup.replicas, data_parallel_kind(setup)
    in_bf16 = bf16_weights(setup)
    cost = share.activations
    one = forward_saved(setup, share, b)
    saved = share.in_flight * one
    tail, last_block = cost.freed_first(b)
    loss = share.loss_tensors * cost.logits_per_sample * b  # the loss's gradient: log-probabilities and logits
    biggest = share.largest_tensor * width  # the embedding (GPT ties it to the head)
    shard = math.ceil(psi / n)
    unit_width = 2 if in_bf16 else width  # FSDP's mixed-precision policy gathers bf16 copies
    root, block = share.outside_blocks * unit_width, share.largest_block * unit_width
    p, g, o = states["params"], states["grads"], states["optimizer"]
    pipeline = setup.strategy in PIPELINES
    accumulating = share.grads_in_forward if pipeline else setup.grad_accum_steps > 1
    fwd = {"params": p, "grads": 0, "optimizer": o, "activations": saved, "other": loss}
    # backward reaches the embedding last; an encoder-decoder's decoder embedding (T5's, the shared
    # one) before the encoder's blocks, whose activations are then still alive
    bwd = {"params": p, "grads": g - biggest, "optimizer": o, "activations": cost.encoder_saved(b),
           "other": 3 * biggest}
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
        everything = share.parameters * unit_width
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
                **gathered_block, "grads": math.ceil(share.largest_block * width / n),
                "activations": saved - tail - last_block, "other": loss + 2 * block}
        # the blocks are done and resharded; the root's (embedding's) gradient is being summed
        bwd.update(params=p + root, grads=g, other=3 * biggest)
    if s == "pp-fsdp":  # FSDP inside a stage: the stage's parameters gathered from the step's first
        # forward to its last backward (reshard_after_forward=False), its gradients whole until the
        # stage's last backward reduce-scatters them
        gathered = p + share.parameters * unit_width
        fwd.update(params=gathered, grads=psi if accumulating else 0)
        bwd.update(params=gathered, grads=psi + g)
    if pipeline:
        phases["backward, others in flight"] = {**bwd, "activations": saved - one}
    temporary = optimizer_step_temporary(setup, share)
    if temporary:  # the step itself: activations gone, every gradient held, the optimizer's temporaries
        phases[STEP_PHASE] = {"params": p, "grads": psi if s == "zero1" else g, "optimizer": o + temporary,
                              "activations": 0, "other": psi if s == "ddp" else 0}
    if setup.activation_checkpointing:  # backward recomputes one block at a time
        recomputed = share.recompute[0] + share.recompute[1] * b
        for name in ("backward", "backward, others in flight"):
            if name in phases:
                phases[name]["activations"] += recomputed
    return phases


def optimizer_step_temporary(setup: Setup, share: RankShare) -> int:
    """Bytes the optimizer's step allocates beside the model states, on a GPU. There torch's
    Adam and AdamW run their foreach implementation (torch.optim.optimizer's
    _default_to_fused_or_foreach picks it for CUDA tensors), whose
    `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` makes one fp32 tensor per
    parameter the rank updates, all alive at once beside parameters, gradients and both
    moments (torch/optim/adam.py, _multi_tensor_adam): 4 bytes per parameter of the rank's
    optimizer share (a shard under ZeRO-1 and beyond; none on the GPU when it is offloaded).
    On a CPU the default is the implementation that loops over tensors, whose
    `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds two temporaries of
    one tensor's size at a time (torch/optim/adam.py, _single_tensor_adam): two of the largest
    tensor the rank updates (measured: gpt2's tied embedding, twice, in the step's peak). SGD's
    foreach step updates in place: 0."""
    if setup.optimizer not in ("adam", "adamw") or setup.offload_optimizer:
        return 0
    shards = setup.replicas if _zero_stage(setup) >= 1 else 1
    if not setup.on_cuda:
        return 2 * math.ceil(share.largest_tensor / shards) * 4
    return math.ceil(share.parameters / shards) * 4


def saved_activations(result: Estimate) -> int:
    """Bytes forward saves for backward on the estimate's rank at its batch, every micro-batch
    in flight included (what a calibration of the machine's peak scales with)."""
    if not result.per_rank_batch:
        return 0
    share = rank_shares(result.setup)[result.pipeline_rank or 0]
    return 0 if share.activations is None else round(share.in_flight * share.activations.saved(result.per_rank_batch))


def per_gpu(cases: dict[str, tuple[Setup, int]], gpu: str) -> dict[str, dict[str, int]]:
    """label -> what the peak rank of each case (a setup and its global batch) holds, per category
    and in total, weighed as the GPU `gpu` runs it (`on_gpu`): the bars of plots.estimate_bars."""
    return {label: estimate(on_gpu(setup, gpu), batch).per_rank_bytes for label, (setup, batch) in cases.items()}


def predict_largest_batch(setup: Setup, memory_bytes: int, calibration=None) -> Estimate | None:
    """Predicted (nothing runs; maxbatch.measure_largest_batch measures it): the estimate for
    the largest global batch whose peak fits in `memory_bytes` per rank
    (global batches step by data-parallel ranks x micro-batches), or None if not even the
    smallest fits. With a `calibration` (multigpu.estimator.accuracy.machine_calibration), what must fit
    is the machine's peak it predicts from the estimate, not the tensors alone. The peak grows
    with the batch, so a doubling search then a bisection find it in a few dozen evaluations
    of the formulas."""
    step = setup.grid.dp * setup.grad_accum_steps

    def fits(k: int) -> bool:
        result = estimate(setup, k * step)
        total = result.per_rank_bytes["total"] if calibration is None else calibration.machine_bytes(result)
        return total <= memory_bytes

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


def predict_longest_sequence(setup: Setup, global_batch: int, memory_bytes: int, step: int, limit: int) -> int:
    """Predicted (experiments.context_parallel.cp_longest measures it): the longest sequence, a
    multiple of `step` up to `limit` (the model's positions), whose peak per rank with
    `global_batch` samples fits `memory_bytes`; 0 if not even `step` tokens fit. The peak grows
    with the sequence, so a bisection finds it in a few estimates."""
    def fits(seq: int) -> bool:
        return estimate(replace(setup, seq_len=seq), global_batch).per_rank_bytes["total"] <= memory_bytes

    lo, hi = 0, limit // step + 1  # in steps: lo fits (0: none yet), hi does not (past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step
