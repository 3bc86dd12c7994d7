"""What one rank holds of the model before any data-parallel sharding, and what one
micro-batch leaves on it for backward (`rank_shares`).

Without tensor or pipeline parallelism that is the whole model and the whole traced forward
(`multigpu.estimator.model_trace`). Under them (the package's GPT only, the model those
strategies cut) a rank holds its pipeline stage(s)' blocks, each weight matrix cut by tp,
and, per micro-batch, that share of the traced activations, taken apart block by block and
cut as Megatron cuts them; a pipeline schedule keeps several micro-batches' activations
alive at once. `multigpu.estimator.peak` puts a step's peak together from these shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from multigpu.estimator.model_trace import ActivationCost, GPTParts, activation_cost, gpt_parts, model_shape
from multigpu.estimator.question import PIPELINES, Setup, _zero_stage, data_parallel_kind
from multigpu.recompute import recompute_mode


@dataclass(frozen=True)
class RankShare:
    """What one rank holds of the model before any data-parallel sharding (the whole model,
    or its pipeline stages' blocks cut by tensor parallelism), and what one micro-batch
    leaves on it for backward."""

    parameters: int
    largest_block: int  # parameters of the largest block it holds (a ZeRO-3 / FSDP unit)
    outside_blocks: int  # parameters outside every block (the embeddings, the final norm, the head)
    blocks: int
    largest_tensor: int  # elements of its largest parameter
    activations: ActivationCost | None  # one micro-batch's saved activations on this rank (None: a bare count)
    recompute: tuple[float, float] = (0, 0)  # checkpointing: one block's activations made again, (fixed, per sample)
    in_flight: float = 1  # micro-batches whose activations are alive at once (a pipeline's schedule)
    loss_tensors: int = 2  # tensors of the log-probabilities' size the loss's gradient makes
    grads_in_forward: bool = False  # a pipeline rank already holds gradients when its activations peak
    pipeline_rank: int | None = None


def bf16_weights(setup: Setup) -> bool:
    """Whether the layers compute with bf16 weights: bf16-master keeps bf16 weights; this
    package's bf16-mixed is autocast over fp32 weights, but FSDP's mixed-precision policy
    gathers bf16 copies."""
    return setup.dtype == "bf16-master" or (setup.dtype == "bf16-mixed" and data_parallel_kind(setup) in
                                            ("fsdp", "pp-fsdp"))


def _traced(setup: Setup, checkpointing: bool) -> ActivationCost:
    # a context-parallel rank's activations are those of its part of the sequence: every layer works
    # token by token, and ring attention keeps what fused attention keeps (its queries, keys,
    # values, output and log-sum-exp), for the rank's own tokens
    autocast = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(setup.dtype, False)
    cost = activation_cost(setup.model, setup.rank_seq_len, setup.target_len,
                           weights="bf16" if bf16_weights(setup) else "fp32", autocast=autocast,
                           checkpointing=checkpointing,
                           dropout=setup.dropout, attention=setup.attention,
                           device="cuda" if setup.on_cuda else "cpu")
    if setup.grid.cp == 1 or setup.cp_attention == "ring":
        return cost
    fixed, per_sample = cp_attention_extra(setup, 2 if autocast else 4)
    layers = gpt_parts(setup.model).layers
    return replace(cost, fixed=cost.fixed + layers * fixed, per_sample=cost.per_sample + layers * per_sample,
                   last_block=(cost.last_block[0] + fixed, cost.last_block[1] + per_sample))


def cp_attention_extra(setup: Setup, width: int) -> tuple[int, int]:
    """(fixed, per sample) bytes one layer's attention keeps beyond ring attention's, per rank, for
    the other two ways of context parallelism (multigpu.strategies.cp_attention), measured on
    gpt-long (records cp_variants: 2 layers, 8,192 tokens, cp 2 and 4) to the byte:
    - allgather: every rank's keys and values, gathered (2 x sequence x width values a sample), and
      the causal mask of its queries against every key, which attention keeps as a float tensor of
      the activations' type (its tokens x the sequence, the same for every sample and head);
    - ulysses: the output once more (the attention's, head-sharded, beside the token-sharded copy
      the next product keeps) and the two int64 orders that sort the gathered tokens."""
    parts, seq, mine = gpt_parts(setup.model), setup.seq_len, setup.rank_seq_len
    if setup.cp_attention == "allgather":
        return mine * seq * width, 2 * seq * parts.d_model * width
    return 2 * seq * 8, mine * parts.d_model * width


@lru_cache(maxsize=256)
def rank_shares(setup: Setup) -> list[RankShare]:
    """One share per pipeline rank (one in all without a pipeline); every data-parallel and
    tensor-parallel rank of a stage holds the same amount."""
    shape, grid = model_shape(setup.model), setup.grid
    if shape.vocab_size is None:  # params:<count>: the model states alone
        return [RankShare(shape.parameters, 0, shape.parameters, 0, 0, None)]
    cost = _traced(setup, setup.activation_checkpointing)
    full = _traced(setup, False) if setup.activation_checkpointing else cost
    if grid.tp == grid.pp == 1:
        blocks = max(1, shape.blocks)
        recompute = ((full.fixed - cost.fixed) / blocks, (full.per_sample - cost.per_sample) / blocks)
        # expert parallelism: a rank keeps 1/ep of every layer's routed experts (its activations are a
        # balanced layer's: it runs as many (token, expert) pairs as it sends, whichever rank's they are).
        # Under FSDP a rank keeps 1/dp of everything either way (the experts' slice sharded over its dp/ep
        # copies); what ep changes there is what a block gathers: its slice of the experts only
        cut = shape.expert_parameters - shape.expert_parameters // grid.ep
        kept = shape.parameters - (0 if _zero_stage(setup) == 3 else cut)
        largest = max(shape.largest_dense_tensor, shape.largest_expert_tensor // grid.ep) if grid.ep > 1 \
            else shape.largest_tensor
        return [RankShare(kept, shape.largest_block - cut // blocks, shape.outside_blocks, shape.blocks, largest, cost,
                          recompute)]
    return [_model_parallel_share(setup, rank, cost, full) for rank in range(grid.pp)]


def _model_parallel_share(setup: Setup, rank: int, cost: ActivationCost, full: ActivationCost) -> RankShare:
    """Pipeline rank `rank`'s stages, each weight matrix cut by tp; its activations are the
    traced ones of its blocks (scaled by `_tp_block_values`), of the embeddings on the first
    stage, of the final norm, head and loss on the last. Micro-batches in flight on a rank:
    GPipe all m (every forward before any backward); 1F1B min(p - rank, m) (its warm-up is
    p - rank - 1 forwards; PipeDream-Flush, Narayanan et al. 2021,
    https://arxiv.org/abs/2104.04473); interleaved 1F1B with v stages per rank p(1 + (p-1)/(pv))
    of a rank's layers on the first rank (Korthikanti et al. 2022, section 4.2.3), and by
    assumption (p - rank) + (p - 1)/v on the others: torch's and Megatron's warm-up of
    (v-1)p + 2(p-1-rank) chunk forwards is p + (p-1-2 rank)/v micro-batches, the same at v = 2
    only, the one v the package runs."""
    from multigpu.strategies.pp import SCHEDULES, stage_indices
    from multigpu.strategies.pp_split import stage_blocks

    parts, grid = gpt_parts(setup.model), setup.grid
    t, p, m = grid.tp, grid.pp, setup.grad_accum_steps
    pipeline, sp = setup.strategy in PIPELINES, setup.sequence_parallel
    schedule = SCHEDULES[setup.strategy] if pipeline else None
    v = schedule.stages_per_rank if pipeline else 1
    stages, num_stages = (stage_indices(schedule, rank, p) if pipeline else [0]), p * v
    blocks = sum(len(stage_blocks(parts.layers, num_stages, i)) for i in stages)
    first, last = 0 in stages, num_stages - 1 in stages
    block = parts.block_whole + parts.block_cut // t
    outside = 0
    if first:
        outside += parts.embedding // t + parts.positions // (t if sp else 1)
    if last:  # a tied head on the first stage's rank is the embedding itself
        outside += parts.final_norm + (0 if parts.tied and first else parts.head // t)

    # activations, (fixed, per sample): the traced whole model's, taken apart
    def times(pair, k):
        return pair[0] * k, pair[1] * k

    L = parts.layers
    embeddings = (cost.fixed - L * cost.last_block[0] - cost.tail[0],
                  cost.per_sample - L * cost.last_block[1] - cost.tail[1])
    mode = recompute_mode(setup.activation_checkpointing)
    k_full = _tp_block_values(parts, t, sp, None) / _tp_block_values(parts, 1, False, None)
    k = _tp_block_values(parts, t, sp, mode) / _tp_block_values(parts, 1, False, mode)
    # a block's part that does not grow with the batch is autocast's bf16 copies of its weights,
    # cut as the weights are
    k_weights = (parts.block_whole + parts.block_cut / t) / (parts.block_whole + parts.block_cut)

    def block_of(traced, k_samples):
        return traced.last_block[0] * k_weights, traced.last_block[1] * k_samples

    one_block = block_of(cost, k)
    recompute = tuple(a - b for a, b in zip(block_of(full, k_full), one_block)) \
        if setup.activation_checkpointing else (0, 0)
    # the loss's log-probabilities are cut by vocabulary where the loss is vocabulary-parallel
    # (tp, fsdp with tp); a pipeline's last stage computes the loss from whole logits. Measured
    # (tp_scaling, compositions): torch's loss_parallel holds one more such tensor in backward
    # than the from-scratch vocabulary-parallel loss
    logits = cost.logits_per_sample / (1 if pipeline else t)
    loss_tensors = 2 if pipeline else 3
    # (the head's fixed part: autocast's bf16 copy of its weight, cut by vocabulary)
    tail = (cost.tail[0] / t, cost.tail[1] - cost.logits_per_sample + logits) if last else (0, 0)
    width = 2 if bf16_weights(setup) else 4
    # the first stage keeps the embeddings' output; a later one the hidden states it received
    stage_input = times(embeddings, 1 / t if sp else 1) if first else (0, setup.seq_len * parts.d_model * width)
    activations = ActivationCost(
        fixed=blocks * one_block[0] + stage_input[0] + tail[0],
        per_sample=blocks * one_block[1] + stage_input[1] + tail[1],
        logits_per_sample=logits if last else 0, tail=tail, last_block=one_block)
    in_flight = {"pp-gpipe": m, "pp-1f1b": min(p - rank, m),
                 "pp-interleaved": (p - rank) + (p - 1) / v}.get(setup.strategy, 1)
    return RankShare(
        parameters=blocks * block + outside, largest_block=block, outside_blocks=outside, blocks=blocks,
        largest_tensor=max(parts.embedding // t if first or last else 0, parts.largest_matrix // t),
        activations=activations, recompute=recompute, in_flight=in_flight, loss_tensors=loss_tensors,
        grads_in_forward=pipeline and setup.strategy != "pp-gpipe" and m > in_flight,
        pipeline_rank=rank if pipeline else None)


def _tp_block_values(parts: GPTParts, t: int, sequence_parallel: bool, recompute: str | None) -> float:
    """Values per token that one block keeps for backward on a rank of tensor-parallel degree `t`.
    The package's block (fused attention, no dropout), with nothing recomputed, keeps
    - whole: the outputs of ln_1 and ln_2 (the inputs of the column-parallel linears, which
      every rank needs whole) and the residual stream after attention and after the MLP
      (the next LayerNorm's inputs): 4h; and the LayerNorms' mean and 1/std: 4;
    - cut: q, k, v (3h) and attention's output (h) of the rank's heads, its log-sum-exp (one
      per head), and the MLP's hidden units before and after GELU (2 d_ff).
    This is Megatron's split (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198,
    section 4.1: s*b*h*(10 + 24/t + 5as/(ht)) bytes per layer in 16 bits) without the
    dropout masks and the attention scores, which this block does not keep. Under sequence
    parallelism, as torch's library runs it, the residual stream and the LayerNorms are cut
    along the sequence too, but each column-parallel linear keeps its all-gathered input
    whole (Megatron's own version gathers it again in backward instead): 2h whole.
    Full recomputation keeps the block's input alone (cut along the sequence under sequence
    parallelism). Selective recomputation (multigpu.recompute) keeps the input, q, k, v,
    attention's output and log-sum-exp, and the MLP's hidden units before GELU; and, with t > 1,
    the results of the functional collectives it does not run again: the two all-reduces' (2h
    whole), or under sequence parallelism the two all-gathers' (2h whole) and the two
    reduce-scatters' (cut)."""
    h, heads, d_ff = parts.d_model, parts.heads, parts.d_ff
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return h / t if sp else h
    if recompute == "selective":
        cut = 4 * h + d_ff + heads
        if t == 1:
            return h + cut
        return 2 * h + (3 * h + cut) / t if sp else 3 * h + cut / t
    cut = 4 * h + 2 * d_ff + heads
    return 2 * h + (cut + 2 * h + 4) / t if sp else 4 * h + 4 + cut / t


# -- where the layout of the tensors, not only their sum, decides: padding and buckets ------------------------------
# (held against dry runs of the strategies' own code: multigpu.estimator.held)


@lru_cache(maxsize=32)
def _layout(model: str) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]] | None:
    import torch

    from multigpu.estimator.model_trace import _build
    from multigpu.models import transformer_blocks

    if model_shape(model).vocab_size is None:
        return None
    with torch.device("meta"):
        built, _ = _build(model)
    rows = tuple((p.shape[0], p[0].numel()) if p.dim() else (1, 1) for p in dict.fromkeys(built.parameters()))
    return rows, tuple(sum(p.numel() for p in b.parameters()) for b in transformer_blocks(built))


def tensor_rows(model: str) -> tuple[tuple[int, int], ...] | None:
    """Each parameter tensor of `model` once, in registration order, as (rows, elements per row); None for a bare
    parameter count."""
    layout = _layout(model)
    return layout and layout[0]


def block_sizes(model: str) -> tuple[int, ...] | None:
    """The parameters of each of `model`'s blocks (a T5's decoder blocks are larger than its encoder's)."""
    layout = _layout(model)
    return layout and layout[1]


def sharded_elements(setup: Setup, share: RankShare) -> int | None:
    """Elements one rank keeps of a model sharded over n ranks, padding included; None where the even share
    ⌈P/n⌉ is the answer or the layout is not known.
    - FSDP2 cuts each tensor along its first dimension: ⌈rows/n⌉ rows a rank (a tensor of fewer rows than ranks
      leaves most of them a row of padding);
    - this package's ZeRO-3 pads each unit's flat buffer (a block, the rest) to a multiple of n."""
    kind, grid, n = data_parallel_kind(setup), setup.grid, setup.replicas
    if grid.pp > 1 or grid.ep > 1 or n == 1:
        return None
    if kind == "fsdp" and grid.tp > 1 and model_shape(setup.model).family == "gpt":
        # FSDP2 shards each tensor-parallel rank's local piece by its rows
        return sum(math.ceil(r / n) * c for r, c in tp_local_rows(setup.model, grid.tp, setup.sequence_parallel))
    if grid.tp > 1:
        return None
    if kind == "fsdp" and (rows := tensor_rows(setup.model)):
        return sum(math.ceil(r / n) * c for r, c in rows)
    if kind == "zero3" and share.blocks and (blocks := block_sizes(setup.model)):
        return sum(math.ceil(b / n) for b in blocks) + math.ceil(share.outside_blocks / n)
    return None


@lru_cache(maxsize=32)
def tp_local_rows(model: str, tp: int, sequence_parallel: bool) -> tuple[tuple[int, int], ...]:
    """(rows, elements per row) of each parameter of the package's GPT as one tensor-parallel rank holds it, by
    the library's plan (strategies/tp_plan.py: a ColwiseParallel layer and a RowwiseParallel embedding cut rows,
    a RowwiseParallel linear cuts columns, the rest is whole)."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from multigpu.estimator.model_trace import _build
    from multigpu.strategies.tp_plan import concrete_plan, gpt_plan, split_qkv

    with torch.device("meta"):
        built, _ = _build(model)
        split_qkv(built)
    cut = {}  # parameter -> the dimension tensor parallelism cuts
    for name, style in concrete_plan(built, gpt_plan(sequence_parallel)).items():
        module = built.get_submodule(name)
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(style, ColwiseParallel) or (isinstance(style, RowwiseParallel)
                                                      and isinstance(module, torch.nn.Embedding)):
                cut[p] = 0
            elif isinstance(style, RowwiseParallel) and pname == "weight":
                cut[p] = 1
    rows = []
    for p in dict.fromkeys(built.parameters()):
        r, per_row = (p.shape[0], p[0].numel()) if p.dim() else (1, 1)
        rows.append((r // tp, per_row) if cut.get(p) == 0 else (r, per_row // tp) if cut.get(p) == 1 else (r, per_row))
    return tuple(rows)


def gradient_buckets(setup: Setup, width: int) -> int:
    """Buckets of gradients DDP's rule makes: backward's order (the last parameters first), a new bucket once the
    one filling holds `bucket_cap_mb` or more (a bucket overfills by up to one tensor, and never splits one)."""
    rows, cap = tensor_rows(setup.model), setup.bucket_cap_mb * 2**20
    if rows is None or setup.grid.tp > 1 or setup.grid.pp > 1 or setup.grid.ep > 1:
        return max(1, math.ceil(model_shape(setup.model).parameters * width / cap))
    count, filled = 1, 0
    for r, c in reversed(rows):
        if filled >= cap:
            count, filled = count + 1, 0
        filled += r * c * width
    return count


def zero2_reduces(setup: Setup, width: int) -> int | None:
    """This package's ZeRO-2 (strategies/zero.py): buckets of contiguous parameters in backward's order, each at
    most the cap and one shard, sent to every rank whose shard it reaches, a reduce per rank reached."""
    rows, n = tensor_rows(setup.model), setup.replicas
    if rows is None or setup.grid.tp > 1 or setup.grid.pp > 1:
        return None
    numels = [r * c for r, c in rows]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    shard = math.ceil(sum(numels) / n)
    cap = min(setup.bucket_cap_mb * 2**20 / width, shard)
    buckets: list[list[int]] = []  # [start, end]
    for i in reversed(range(len(numels))):
        if buckets and buckets[-1][1] - starts[i] <= cap:
            buckets[-1][0] = starts[i]
        else:
            buckets.append([starts[i], starts[i] + numels[i]])
    return sum((end - 1) // shard - start // shard + 1 for start, end in buckets)
