"""The estimator's question: this model, this strategy, this grid of ranks, this batch
(`Setup`), checked before anything is counted; and what a GPU holds besides the step's
tensors (the CUDA context, cuBLAS's workspaces, the allocator's rounding).

The grid is the package's one rule (`multigpu.grid.resolve_grid`, which `RunConfig` reads
too); the checks here are the estimator's own: the strategies it models (the strategy
table's `estimated_as`), the precisions it counts, and which models tensor and pipeline
parallelism can cut. `multigpu.estimator.share` then says what one rank holds of the model,
and `multigpu.estimator.peak` what a step holds at its peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from multigpu.config import OPTIMIZERS
from multigpu.errors import ConfigError
from multigpu.estimator.model_trace import gpt_parts, model_shape
from multigpu.grid import Grid, resolve_grid
from multigpu.strategy_table import ESTIMATED, STRATEGY_TABLE, ZERO_STAGE

# the strategies the estimator models as themselves (the strategy table's ESTIMATED), by how
# their ranks divide the model: the data-parallel ones (and single) each hold all of it, whole
# or sharded between steps; the pipelines (the library's schedules, strategies/pp.py) cut it
# into stages; tp, the one left, cuts every weight matrix
DATA_PARALLEL = tuple(s for s in ESTIMATED if STRATEGY_TABLE[s].spans in ("none", "dp"))
PIPELINES = tuple(s for s in ESTIMATED if STRATEGY_TABLE[s].spans == "pp")

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
    activation_checkpointing: bool | str = False  # True or "full", "selective" (multigpu.recompute)
    grad_accum_steps: int = 1
    reshard_after_forward: bool = True  # fsdp: False keeps the gathered units from forward to backward
    offload_optimizer: bool = False  # ZeRO-Offload: the optimizer state and step live in host memory
    bucket_cap_mb: float = 25.0
    cuda_context_bytes: int = 0  # what the CUDA context takes on each GPU (0 on CPU)
    cuda_workspace_bytes: int = 0  # cuBLAS's workspaces on each GPU (cublas_workspace_bytes; 0 on CPU)
    on_cuda: bool = False  # a GPU: the allocator's 512-byte rounding counts (allocator_rounding_bytes), the
    # optimizer step's foreach temporary, a dropout keeps a 1-byte mask and fused attention its output and
    # log-sum-exp only (model_trace._AliveStorages); False: this CPU's kernels, as traced
    dropout: bool = True  # the model's own dropout (T5 as released: 0.1); False: none, as parity runs train
    attention: str = "sdpa"  # "sdpa" (one fused call) or "eager" (T5 only: its operations one by one)
    backend: str = "nccl"  # "gloo" (CPU): its reduce-scatter works on a copy of the whole input
    # the rank grid, as RunConfig has it: world_size = dp x pp x tp
    tp: int = 1  # tensor-parallel degree: with fsdp (2D), with a pipeline, or the strategy tp (default: all ranks)
    pp: int = 1  # pipeline ranks, with a pp-* strategy (default: what tp leaves); its micro-batches: grad_accum_steps
    sequence_parallel: bool = False  # tensor parallel: the residual stream and LayerNorms cut along the sequence
    cp: int = 1  # context-parallel degree: cp-scratch (default: all ranks), or fsdp with cp; zig-zag layout
    cp_attention: str = "ring"  # with cp > 1: "ring", "allgather" or "ulysses" (multigpu.strategies.cp_layout)
    ep: int | None = None  # expert-parallel degree inside dp (ep-scratch; None: every dp rank its own experts)

    @property
    def replicas(self) -> int:
        """Ranks that hold the same piece of the model: the data-parallel ranks and, since each
        of them holds the whole model too, the context-parallel ranks (FSDP shards over both)."""
        return self.grid.dp * self.grid.cp

    @property
    def rank_seq_len(self) -> int:
        """Tokens of each sequence one rank holds."""
        return self.seq_len // self.grid.cp

    @property
    def grid(self) -> Grid:
        """The rank grid, by the one rule (`multigpu.grid.resolve_grid`): a strategy's own name
        spans what the degrees given leave (`tp` alone is tp = world size; a pipeline is
        pp = world size / tp unless pp is given; a data-parallel strategy is dp = world size /
        (tp x pp)), and a pipeline given its pp takes the ranks left as data-parallel ranks
        (FSDP inside each stage). Raises ConfigError, with the arithmetic, for degrees that do
        not tile the world or that the strategy does not take."""
        return resolve_grid(self.strategy, self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)


MAX_SEQ_LEN = 2**20  # a million tokens: beyond any model here, and beyond what a trace can allocate


def check_setup(setup: Setup) -> None:
    """Whether the estimator can answer `setup`, or a ConfigError that says why not."""
    if setup.strategy not in ESTIMATED:
        raise ConfigError(f"the estimator knows the strategies {', '.join(ESTIMATED)}; got {setup.strategy!r}")
    if setup.dtype not in ESTIMATOR_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(ESTIMATOR_DTYPES)}, got {setup.dtype!r}")
    if setup.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {setup.optimizer!r}")
    grid = setup.grid  # the degrees are whole numbers, the strategy takes them and they tile the world
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
    from multigpu.recompute import recompute_mode

    recompute_mode(setup.activation_checkpointing)
    _check_cut(setup, grid)


def _check_cut(setup: Setup, grid: Grid) -> None:
    """The model can be cut as the grid cuts it: sequence parallelism where tensor parallelism
    runs it, the package's GPT under tp or a pipeline, heads and widths that tp divides, blocks
    enough for the pipeline's stages and micro-batches its schedule can run."""
    s = setup.strategy
    if setup.sequence_parallel and (grid.tp == 1 or s in PIPELINES):
        raise ConfigError("sequence parallelism cuts along the sequence what tensor parallelism keeps whole: it needs "
                          "tp > 1, and the pipelines do not run it inside their stages")
    from multigpu.models import family, tensor_parallel_problems

    experts = model_shape(setup.model).experts
    takes_experts = "ep" in STRATEGY_TABLE[s].combines
    if (STRATEGY_TABLE[s].spans_experts or grid.ep > 1) and not experts:
        raise ConfigError(f"{s} cuts a mixture of experts' experts; {setup.model} has none: use a gpt-moe-* preset")
    if experts and not takes_experts and s != "single":  # as RunConfig refuses it (ep_scratch.expert_problems)
        raise ConfigError(f"a mixture of experts trains here with single, ep-scratch or fsdp (--ep 1: plain data "
                          f"parallel of it), not {s}: its balancing loss counts the whole batch's tokens")
    if experts % grid.ep:
        raise ConfigError(f"ep {grid.ep} does not divide the {experts} experts of each layer")
    if experts and (grid.tp > 1 or grid.pp > 1 or grid.cp > 1):  # as RunConfig refuses it (expert_problems)
        raise ConfigError(f"{s} of a mixture of experts composes with ep here, not yet with tensor, pipeline or "
                          "context parallelism")
    if grid.cp > 1:
        from multigpu.strategies.cp_attention import sequence_problem

        if setup.model.startswith("params:") or family(setup.model) != "gpt":
            raise ConfigError(f"context parallelism is estimated for the package's GPT (a gpt-* preset or a gpt2 "
                              f"config.json), whose attention it swaps; not {setup.model}")
        why = sequence_problem(setup.seq_len, grid.cp, "zigzag")
        if why:
            raise ConfigError(why)
        from multigpu.strategies.cp_layout import VARIANTS

        if setup.cp_attention not in VARIANTS:
            raise ConfigError(f"cp_attention {setup.cp_attention!r}: one of {', '.join(VARIANTS)}")
        heads = gpt_parts(setup.model).heads
        if setup.cp_attention == "ulysses" and heads % grid.cp:
            raise ConfigError(f"Ulysses gives each of the cp={grid.cp} ranks whole heads, and {setup.model} has "
                              f"{heads}: use a cp that divides {heads}, or cp_attention ring or allgather")
        if setup.cp_attention != "ring" and setup.activation_checkpointing:
            raise ConfigError(f"the estimator models cp_attention {setup.cp_attention!r} without recomputation "
                              "only; ring attention with it")
        if grid.pp > 1 or (grid.tp > 1 and setup.strategy != "fsdp"):
            raise ConfigError("context parallelism composes with data parallelism, FSDP and FSDP x TP here, not with "
                              "pipeline parallelism")
    if grid.tp == grid.pp == 1:
        return

    kind = "a bare parameter count" if setup.model.startswith("params:") else f"a {family(setup.model)} model"
    if kind != "a gpt model":
        raise ConfigError(f"tensor and pipeline parallelism are estimated for the package's GPT (a gpt-* preset or a "
                          f"gpt2 config.json), the model those strategies cut; {setup.model} is {kind}")
    if grid.tp > 1:
        problems = tensor_parallel_problems(setup.model, grid.tp, setup.seq_len, setup.sequence_parallel)
        if problems:
            raise ConfigError(f"tp {grid.tp} cannot split {setup.model}: " + "; ".join(problems))
    if s in PIPELINES:
        from multigpu.strategies.pp import SCHEDULES, microbatch_problem

        v, layers = SCHEDULES[s].stages_per_rank, gpt_parts(setup.model).layers
        if grid.pp * v > layers:
            raise ConfigError(f"{s} cuts {setup.model} into {grid.pp * v} stages ({grid.pp} ranks x {v}) but it has "
                              f"{layers} blocks; use at most {layers // v} pipeline ranks")
        why = microbatch_problem(s, setup.grad_accum_steps, grid.pp)
        if why:
            raise ConfigError(why)


# -- how the ranks holding the same piece of the model work together --------------------------


def data_parallel_kind(setup: Setup) -> str:
    """How the ranks holding the same piece of the model work together: the data-parallel
    strategy's own way; "single" for tensor parallelism or a pipeline with no data-parallel
    ranks; "pp-fsdp" for FSDP inside a pipeline's stages."""
    if STRATEGY_TABLE[setup.strategy].spans_experts:  # ep-scratch: ddp-scratch's buckets over its share
        return "ddp"
    if setup.strategy in DATA_PARALLEL:
        return setup.strategy
    if STRATEGY_TABLE[setup.strategy].spans == "cp":  # cp-scratch: whole replicas, a flat copy of the gradients
        return "ddp"
    if setup.strategy in PIPELINES and setup.grid.dp > 1:
        return "pp-fsdp"
    return "single"


def _zero_stage(setup: Setup) -> int:
    """What the data-parallel ranks shard between steps, as a ZeRO stage (FSDP's for a
    pipeline's data-parallel ranks)."""
    return 3 if data_parallel_kind(setup) == "pp-fsdp" else ZERO_STAGE.get(data_parallel_kind(setup), 0)


def on_gpu(setup: Setup, gpu: str) -> Setup:
    """`setup` as it runs on the GPU `gpu` (a GPUS name), as `estimate --gpu` weighs it: the GPU's
    kernels and allocator (on_cuda), its cuBLAS workspaces, and the CUDA context the command line
    assumes (DEFAULT_CUDA_CONTEXT)."""
    if gpu not in GPUS:
        raise ConfigError(f"unknown GPU {gpu!r}: one of {', '.join(GPUS)}")
    return replace(setup, on_cuda=True, cuda_context_bytes=DEFAULT_CUDA_CONTEXT,
                   cuda_workspace_bytes=cublas_workspace_bytes(gpu))
