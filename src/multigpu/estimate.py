"""Memory per rank, estimated before anything runs.

Two parts, derived differently:

- **Model states** (parameters, gradients, optimizer state) follow the ZeRO paper's formulas
  (`multigpu.memory.zero_model_states`), from the exact parameter count of the model
  (`multigpu.trace.model_shape`, built on the meta device).
- **Activations** are *traced once* on fake tensors, at batch 1 and 2
  (`multigpu.trace.activation_cost`): a fixed part and a per-sample part, so every batch
  size after that is arithmetic: no candidate is traced.

What a step holds at its peak is then put together phase by phase (`estimate`);
`multigpu.accuracy` sets the estimates beside the records.

Under tensor and pipeline parallelism (the package's GPT only, the model those strategies
cut) a rank holds a share of both (`rank_shares`): the blocks of its pipeline stage(s),
each weight matrix cut by tp, and, per micro-batch, that share of the traced activations;
a pipeline schedule keeps several micro-batches' activations alive at once. The estimate
is that of the most loaded pipeline rank, which is what must fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

from multigpu.config import ConfigError
from multigpu.memory import CATEGORIES
from multigpu.trace import ActivationCost, _build, activation_cost, model_shape

# -- the question: a model, a strategy, a grid of ranks ------------------------------------------

DATA_PARALLEL = ("single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp")
PIPELINES = ("pp-gpipe", "pp-1f1b", "pp-interleaved")  # the library's schedules (strategies/pp.py)
ESTIMATED = (*DATA_PARALLEL, "tp", *PIPELINES)
# fp32; bf16-mixed as this package runs it (autocast: fp32 parameters, gradients and optimizer
# state, bf16 compute); bf16-master as the ZeRO paper and DeepSpeed count mixed precision (bf16
# parameters and gradients, an fp32 master copy of the weights in the optimizer state); fp16-mixed
# is bf16-mixed's memory (autocast to fp16, as wide; its loss scaler keeps two scalars)
ESTIMATOR_DTYPES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master")
# what the CUDA context takes on each GPU when nobody says (the command line's default with --gpu):
# "a few hundred MiB" (PyTorch's notes on CUDA semantics); it depends on the driver, the CUDA
# version and the kernels loaded, so measure yours (nvidia-smi after torch.cuda.init()) and give it
DEFAULT_CUDA_CONTEXT = 500 * 2**20
GPUS = {  # name -> the memory its name says, read as GiB; the usable amount is a little less on some cards,
    # so give --gpu-memory where it matters
    "v100-16gb": 16 * 2**30, "v100-32gb": 32 * 2**30, "a10-24gb": 24 * 2**30, "a100-40gb": 40 * 2**30,
    "a100-80gb": 80 * 2**30, "l4-24gb": 24 * 2**30, "l40s-48gb": 48 * 2**30, "h100-80gb": 80 * 2**30,
    "h200-141gb": 141 * 2**30, "rtx4090-24gb": 24 * 2**30,
}


def cublas_workspace_bytes(gpu_name: str | None, capability: tuple[int, int] | None = None,
                           workspace_size: int | None = None) -> int:
    """What cuBLAS's workspaces take of a GPU during training, through the caching allocator
    (so `torch.cuda.max_memory_allocated` counts them; the memory tracker, which counts
    tensors, does not): one workspace per (handle, stream), and a step uses two handles, the
    forward's thread and autograd's backward thread (the map of workspaces per handle and
    stream: ATen/cuda/CUDAContextLight.h). 0 off a GPU.

    One workspace's size, best known first:
    - `workspace_size`: what torch itself said on the run's GPU
      (`torch.backends.cuda.cublas_workspace_size()`, recorded in a record's provenance); it
      also follows CUBLAS_WORKSPACE_CONFIG, which nothing below can know;
    - `capability`, the GPU's compute capability (major, minor): 4096 KiB x 8 = 32 MiB on
      majors 9, 10 and 12 and on sm 11.0 (pytorch PRs #175344 and #189312,
      aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize), else
      4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB;
    - the GPU's name, where nothing else is known (a --gpu name, a record written before
      provenance kept the two above): 32 MiB for the Hopper and data-centre Blackwell names
      below (GH200 and GB200/GB300 contain them)."""
    if workspace_size is not None:
        return 2 * workspace_size
    large, small = 4096 * 1024 * 8, 4096 * 1024 * 2 + 16 * 1024 * 8
    if capability is not None:
        major, minor = capability
        return 2 * (large if major in (9, 10, 12) or (major, minor) == (11, 0) else small)
    if not gpu_name:
        return 0
    hopper = any(tag in gpu_name.lower() for tag in ("h100", "h200", "h800", "b100", "b200", "b300"))
    return 2 * (large if hopper else small)


def allocator_rounding_bytes(setup: Setup) -> int:
    """The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes
    (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize), and MemTracker counts the rounded
    size on CUDA (torch/distributed/_tools/mem_tracker.py): at most 511 bytes per tensor.
    An upper bound: every parameter tensor's parameter, gradient and optimizer copies
    (AdamW: two) each lose 511 bytes. 0 off a GPU."""
    if not setup.on_cuda:
        return 0
    copies = 2 + {"sgd": 0, "sgd-momentum": 1}.get(setup.optimizer, 2)
    return model_shape(setup.model).tensors * copies * 511


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
    cuda_workspace_bytes: int = 0  # cuBLAS's workspaces on each GPU (cublas_workspace_bytes; 0 on CPU)
    on_cuda: bool = False  # a GPU: the allocator's 512-byte rounding counts (allocator_rounding_bytes), the
    # optimizer step's foreach temporary, a dropout keeps a 1-byte mask and fused attention its output and
    # log-sum-exp only (multigpu.trace._AliveStorages); False: this CPU's kernels, as traced
    dropout: bool = True  # the model's own dropout (T5 as released: 0.1); False: none, as parity runs train
    attention: str = "sdpa"  # "sdpa" (one fused call) or "eager" (T5 only: its operations one by one)
    backend: str = "nccl"  # "gloo" (CPU): its reduce-scatter works on a copy of the whole input
    # the rank grid, as RunConfig has it: world_size = dp x pp x tp
    tp: int = 1  # tensor-parallel degree: with fsdp (2D), with a pipeline, or the strategy tp (default: all ranks)
    pp: int = 1  # pipeline ranks, with a pp-* strategy (default: what tp leaves); its micro-batches: grad_accum_steps
    sequence_parallel: bool = False  # tensor parallel: the residual stream and LayerNorms cut along the sequence


def degrees(setup: Setup) -> dict[str, int]:
    """{"dp", "pp", "tp"}: the rank grid, read as `RunConfig.degrees` reads it. A strategy's
    own name spans what the others leave: `tp` alone is tp = world size; a pipeline is
    pp = world size / tp unless pp is given; a data-parallel strategy is dp = world size /
    (tp x pp). One difference: a pipeline given both pp and tp takes the ranks left as its
    data-parallel ranks (FSDP inside each stage), where a run asks for them (--dp)."""
    n, tp, pp = setup.world_size, setup.tp, setup.pp
    if setup.strategy == "tp" and tp == 1:
        tp = n
    if setup.strategy in PIPELINES and pp == 1:
        pp = max(1, n // tp)
    return {"dp": max(1, n // (tp * pp)), "pp": pp, "tp": tp}


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
        return {"setup": asdict(self.setup), "degrees": degrees(self.setup), "global_batch": self.global_batch,
                "batch_size": self.global_batch, "per_rank_batch": self.per_rank_batch,
                "per_rank_bytes": self.per_rank_bytes, "phase": self.phase, "pipeline_rank": self.pipeline_rank,
                "method": self.method}


# -- what one rank holds of the model -------------------------------------------------------


@dataclass(frozen=True)
class GPTParts:
    """A GPT's parameters as tensor and pipeline parallelism divide them: tensor parallelism
    cuts every weight matrix and the vocabulary (strategies/tp.py's plan) and leaves the
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

    with torch.device("meta"):
        built, _ = _build(model)
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


def _tp_block_values(parts: GPTParts, sequence_parallel: bool) -> tuple[int, int]:
    """(kept whole, cut by t): values per token that one block saves for backward, split by
    what a tensor-parallel rank keeps of them. The package's block (fused attention, no
    dropout) saves, per token:
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
    whole (Megatron's own version gathers it again in backward instead): 2h whole."""
    h, cut = parts.d_model, 4 * parts.d_model + 2 * parts.d_ff + parts.heads
    if sequence_parallel:
        return 2 * h, cut + 2 * h + 4
    return 4 * h + 4, cut


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
    return activation_cost(setup.model, setup.seq_len, setup.target_len,
                           weights="bf16" if bf16_weights(setup) else "fp32",
                           autocast={"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(setup.dtype, False),
                           checkpointing=checkpointing,
                           dropout=setup.dropout, attention=setup.attention,
                           device="cuda" if setup.on_cuda else "cpu")


@lru_cache(maxsize=256)
def rank_shares(setup: Setup) -> list[RankShare]:
    """One share per pipeline rank (one in all without a pipeline); every data-parallel and
    tensor-parallel rank of a stage holds the same amount."""
    shape, d = model_shape(setup.model), degrees(setup)
    if shape.vocab_size is None:  # params:<count>: the model states alone
        return [RankShare(shape.parameters, 0, shape.parameters, 0, 0, None)]
    cost = _traced(setup, setup.activation_checkpointing)
    full = _traced(setup, False) if setup.activation_checkpointing else cost
    if d["tp"] == d["pp"] == 1:
        blocks = max(1, shape.blocks)
        recompute = ((full.fixed - cost.fixed) / blocks, (full.per_sample - cost.per_sample) / blocks)
        return [RankShare(shape.parameters, shape.largest_block, shape.outside_blocks, shape.blocks,
                          shape.largest_tensor, cost, recompute)]
    return [_model_parallel_share(setup, rank, cost, full) for rank in range(d["pp"])]


def _model_parallel_share(setup: Setup, rank: int, cost: ActivationCost, full: ActivationCost) -> RankShare:
    """Pipeline rank `rank`'s stages, each weight matrix cut by tp; its activations are the
    traced ones of its blocks (scaled by `_tp_block_values`), of the embeddings on the first
    stage, of the final norm, head and loss on the last. Micro-batches in flight on a rank:
    GPipe all m (every forward before any backward); 1F1B min(p - rank, m) (its warm-up is
    p - rank - 1 forwards; PipeDream-Flush, Narayanan et al. 2021,
    https://arxiv.org/abs/2104.04473); interleaved 1F1B with v stages per rank p(1 + (p-1)/(pv))
    of a rank's layers on the first rank (Korthikanti et al. 2022, section 4.2.3), and by
    assumption (p - rank) + (p - 1)/v on the others."""
    from multigpu.strategies.pp import SCHEDULES, stage_indices
    from multigpu.strategies.pp_split import stage_blocks

    parts, d = gpt_parts(setup.model), degrees(setup)
    t, p, m = d["tp"], d["pp"], setup.grad_accum_steps
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
    whole, cut = _tp_block_values(parts, sp)
    k_full = (whole + cut / t) / (whole + cut)
    k = (1 / t if sp else 1) if setup.activation_checkpointing else k_full  # a checkpointed block keeps its input
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


# -- the peak of one training step, per rank ---------------------------------------------------


def data_parallel_kind(setup: Setup) -> str:
    """How the ranks holding the same piece of the model work together: the data-parallel
    strategy's own way; "single" for tensor parallelism or a pipeline with no data-parallel
    ranks; "pp-fsdp" for FSDP inside a pipeline's stages."""
    if setup.strategy in DATA_PARALLEL:
        return setup.strategy
    if setup.strategy in PIPELINES and degrees(setup)["dp"] > 1:
        return "pp-fsdp"
    return "single"


def _zero_stage(setup: Setup) -> int:
    """What the data-parallel ranks shard between steps, as a ZeRO stage (FSDP's for a
    pipeline's data-parallel ranks)."""
    from multigpu.config import ZERO_STAGE

    return 3 if data_parallel_kind(setup) == "pp-fsdp" else ZERO_STAGE.get(data_parallel_kind(setup), 0)


def model_states(setup: Setup, share: RankShare | None = None) -> dict[str, int]:
    """Parameters, gradients and optimizer state a rank keeps between steps (the ZeRO
    formulas: `multigpu.memory.zero_model_states`) of its share of the model (default: the
    most loaded pipeline rank's)."""
    from multigpu.memory import zero_model_states

    if share is None:
        return max((model_states(setup, s) for s in rank_shares(setup)), key=lambda states: sum(states.values()))
    stage = _zero_stage(setup)
    accounting = "bf16-master" if setup.dtype == "bf16-master" else "fp32"  # autocast keeps fp32 weights
    states = zero_model_states(share.parameters, degrees(setup)["dp"] if stage else 1, stage, setup.optimizer,
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
    _check(setup)
    d = degrees(setup)
    method = "ZeRO formulas for the model states"
    if d["tp"] > 1 or d["pp"] > 1:
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
    if d["tp"] > 1:
        method += ", cut by tp as Megatron cuts them (Korthikanti et al. 2022)"
    if d["pp"] > 1:
        method += ", times the schedule's micro-batches in flight"
    return Estimate(setup, global_batch, b, per_rank, phase, f"{method}; the peak from the step's phases", rank,
                    tied)


MAX_SEQ_LEN = 2**20  # a million tokens: beyond any model here, and beyond what a trace can allocate


def _check(setup: Setup) -> None:
    from multigpu.config import OPTIMIZERS

    if setup.strategy not in ESTIMATED:
        raise ConfigError(f"the estimator knows the strategies {', '.join(ESTIMATED)}; got {setup.strategy!r}")
    if setup.dtype not in ESTIMATOR_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(ESTIMATOR_DTYPES)}, got {setup.dtype!r}")
    if setup.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {setup.optimizer!r}")
    for name in ("world_size", "tp", "pp"):
        value = getattr(setup, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name.replace('_', ' ')} must be a whole number of at least 1, got {value!r}")
    if setup.strategy == "single" and setup.world_size != 1:
        raise ConfigError("strategy single runs on one device: use --world-size 1")
    if setup.seq_len < 1 or (setup.target_len is not None and setup.target_len < 1):
        raise ConfigError("sequence lengths must be at least 1")
    longest = max(setup.seq_len, setup.target_len or 0)
    if longest > MAX_SEQ_LEN:  # attention's scores alone would be seq_len^2 per head and sample
        raise ConfigError(f"a sequence of {longest:,} tokens is beyond what the estimator traces (at most "
                          f"{MAX_SEQ_LEN:,}: one attention score matrix would be {longest**2 * 4 / 2**40:,.0f} TiB); "
                          "use a shorter --seq-len")
    if setup.grad_accum_steps < 1:
        raise ConfigError(f"gradient accumulation steps must be at least 1, got {setup.grad_accum_steps}")
    if setup.offload_optimizer and setup.strategy not in ("zero1", "zero2", "zero3"):
        raise ConfigError("optimizer offload (ZeRO-Offload) goes with a ZeRO stage: zero1, zero2 or zero3")
    _check_grid(setup)


def _check_grid(setup: Setup) -> None:
    """The degrees tile the world, the strategy takes them, and the model can be cut so."""
    s, d = setup.strategy, degrees(setup)
    given = [f"{k} {getattr(setup, k)}" for k in ("tp", "pp") if getattr(setup, k) > 1]
    if (s in DATA_PARALLEL and s != "fsdp" and given) or (s in ("fsdp", "tp") and setup.pp > 1):
        raise ConfigError(f"strategy {s} does not combine with {' and '.join(given)}: tensor parallelism goes with "
                          f"fsdp (2D), with a pipeline or alone (tp); pipeline parallelism is a strategy of its own "
                          f"({', '.join(PIPELINES)}), with tp and data-parallel ranks inside")
    if d["dp"] * d["pp"] * d["tp"] != setup.world_size:
        raise ConfigError(f"world size {setup.world_size} is not a multiple of pp {d['pp']} x tp {d['tp']} "
                          f"= {d['pp'] * d['tp']}; use a world size of {d['pp'] * d['tp']}, "
                          f"{2 * d['pp'] * d['tp']}, ...")
    if s == "tp" and d["dp"] > 1:
        raise ConfigError(f"strategy tp is tensor parallel only, but world size {setup.world_size} with tp {d['tp']} "
                          f"leaves {d['dp']} data-parallel ranks: use fsdp with tp {d['tp']} (2D)")
    if setup.sequence_parallel and (d["tp"] == 1 or s in PIPELINES):
        raise ConfigError("sequence parallelism cuts along the sequence what tensor parallelism keeps whole: it needs "
                          "tp > 1, and the pipelines do not run it inside their stages")
    if d["tp"] == d["pp"] == 1:
        return
    from multigpu.models import family, tensor_parallel_problems

    kind = "a bare parameter count" if setup.model.startswith("params:") else f"a {family(setup.model)} model"
    if kind != "a gpt model":
        raise ConfigError(f"tensor and pipeline parallelism are estimated for the package's GPT (a gpt-* preset or a "
                          f"gpt2 config.json), the model those strategies cut; {setup.model} is {kind}")
    if d["tp"] > 1:
        problems = tensor_parallel_problems(setup.model, d["tp"], setup.seq_len, setup.sequence_parallel)
        if problems:
            raise ConfigError(f"tp {d['tp']} cannot split {setup.model}: " + "; ".join(problems))
    if s in PIPELINES:
        from multigpu.strategies.pp import SCHEDULES, microbatch_problem

        v, layers = SCHEDULES[s].stages_per_rank, gpt_parts(setup.model).layers
        if d["pp"] * v > layers:
            raise ConfigError(f"{s} cuts {setup.model} into {d['pp'] * v} stages ({d['pp']} ranks x {v}) but it has "
                              f"{layers} blocks; use at most {layers // v} pipeline ranks")
        why = microbatch_problem(s, setup.grad_accum_steps, d["pp"])
        if why:
            raise ConfigError(why)


def _per_rank_batch(setup: Setup, global_batch: int) -> int:
    """Samples per data-parallel rank per micro-batch."""
    dp, m = degrees(setup)["dp"], setup.grad_accum_steps
    per_step = dp * m
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % per_step:
        over = "world size" if dp == setup.world_size else "data-parallel ranks"
        raise ConfigError(f"the global batch ({global_batch!r}) must be a positive multiple of {over} x "
                          f"{'micro-batches' if setup.strategy in PIPELINES else 'accumulation steps'} "
                          f"({dp} x {m} = {per_step})")
    return global_batch // per_step


STEP_PHASE = "optimizer step"  # the phase an optimizer's step temporaries make (none for SGD)


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
    shape = model_shape(setup.model)
    width = 2 if setup.dtype == "bf16-master" else 4  # bytes of a parameter, and of its gradient
    psi, n, s = share.parameters * width, degrees(setup)["dp"], data_parallel_kind(setup)
    in_bf16 = bf16_weights(setup)
    cost = share.activations
    # T5's logits are freed before backward
    one = cost.saved(b) - (cost.logits_per_sample * b if shape.family == "t5" else 0)
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
    shards = degrees(setup)["dp"] if _zero_stage(setup) >= 1 else 1
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


def predict_largest_batch(setup: Setup, memory_bytes: int, calibration=None) -> Estimate | None:
    """Predicted (nothing runs; maxbatch.measure_largest_batch measures it): the estimate for
    the largest global batch whose peak fits in `memory_bytes` per rank
    (global batches step by data-parallel ranks x micro-batches), or None if not even the
    smallest fits. With a `calibration` (multigpu.accuracy.machine_calibration), what must fit
    is the machine's peak it predicts from the estimate, not the tensors alone. The peak grows
    with the batch, so a doubling search then a bisection find it in a few dozen evaluations
    of the formulas."""
    step = degrees(setup)["dp"] * setup.grad_accum_steps

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
