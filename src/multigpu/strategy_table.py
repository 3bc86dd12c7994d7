"""The strategy table: every strategy's name and everything the rest of the package may know
about it without importing it (how it works lives in its module under strategies/, and
nowhere else). The config, the estimator, the advisor, the calculator and the figures read
their lists from here, so a new strategy is one module plus one row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """One row of the strategy table."""

    module: str  # multigpu.strategies.<module>: its prepare(model, cfg, rt) builds it
    description: str
    shards: str  # what a rank holds a part of, rather than the whole
    zero_stage: int | None = 0  # data parallel: what it shards as a ZeRO stage; None: not data parallel
    spans: str = "dp"  # the grid dimension the strategy's own name spans (dp: one replica per rank)
    combines: tuple[str, ...] = ()  # further grid dimensions it can be given (--tp, --pp, --cp, --dp, --ep)
    one_process: bool = False  # every replica a thread of one process (no process group)
    # the strategy the estimator models this one as (its own name: modelled as it is); None: not modelled
    estimated_as: str | None = None
    # what of its communication can hide behind compute: "backward" (gradient buckets sent while
    # backward runs), "all" (also the parameter gathers, prefetched during forward), "none"
    overlap: str = "none"
    # None: fp16-mixed (float16 autocast with torch.amp.GradScaler) is right with it; otherwise why not
    fp16_refusal: str | None = "its gradients or its step are not the plain ones GradScaler expects"
    checkpoints_itself: bool = False  # applies activation checkpointing at its own place in compose's order
    cuda_only: str | None = None  # why it runs on CUDA GPUs only (the device plan refuses the CPU), if it does
    spans_experts: bool = False  # its own name cuts a mixture of experts' experts: ep defaults to every dp rank
    advised: bool = False  # one of the data-parallel plans the advisor weighs (strategies the estimator models)


_DP = "nothing: every rank holds the whole model"
_FSDP_FP16 = ("FSDP shards the gradients, so the overflow check must be combined over the ranks: it needs "
              "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which this package does not wire in")
_ZERO_FP16 = ("each rank's optimizer updates only its shard, so a plain GradScaler checks only that shard "
              "for overflow and one rank could skip a step that another takes")
_DEEPSPEED_FP16 = ("DeepSpeed scales the loss itself, through the fp16 section of its config (a dynamic loss scale "
                   "inside the engine), which this package does not set")
_TP_FP16 = ("each rank holds a slice of every weight's gradient, so an overflow on one rank must skip the "
            "step on all of them, which a plain GradScaler does not do")
_PP_FP16 = ("each stage holds only its layers' gradients and the schedule runs backward itself, outside "
            "the loop that scales the loss")
_TP_SHARDS = ("every weight matrix, by rows or columns; activations inside each block (and between blocks "
              "with SP)")
_FSDP_SHARDS = "optimizer state, gradients, parameters"
_CP_FP16 = ("its step finishes the gradient all-reduce and updates in one call, leaving no point at which "
            "GradScaler could unscale and check the averaged gradients")

STRATEGY_TABLE: dict[str, Strategy] = {
    "single": Strategy("single", "one process, one device: the reference every strategy is tested against",
                       "nothing (one device)", spans="none", estimated_as="single", fp16_refusal=None),
    "ddp": Strategy("ddp", "PyTorch DistributedDataParallel", _DP, estimated_as="ddp", overlap="backward",
                    fp16_refusal=None, advised=True),
    "ddp-scratch": Strategy("ddp_scratch", "data parallel from scratch: bucketed all-reduce overlapped with backward "
                                           "(with --tp: over tp-scratch's layers, 2D from scratch)", _DP,
                            combines=("tp",), estimated_as="ddp", overlap="backward",
                            fp16_refusal="its step finishes the gradient all-reduce and updates in one call, "
                                         "leaving no point at which GradScaler could unscale and check the "
                                         "averaged gradients"),
    "dp": Strategy("dp", "DataParallel: one process, one thread per replica (nn.DataParallel on GPUs, "
                         "from scratch on CPU)", _DP, one_process=True, estimated_as="dp", fp16_refusal=None),
    "zero1": Strategy("zero", "ZeRO stage 1 from scratch: optimizer state sharded", "optimizer state", 1,
                      estimated_as="zero1", fp16_refusal=_ZERO_FP16, advised=True),
    "zero2": Strategy("zero", "ZeRO stage 2 from scratch: optimizer state and gradients sharded",
                      "optimizer state, gradients", 2, estimated_as="zero2", overlap="backward",
                      fp16_refusal=_ZERO_FP16, advised=True),
    "zero3": Strategy("zero", "ZeRO stage 3 from scratch: optimizer state, gradients and parameters sharded",
                      _FSDP_SHARDS, 3, estimated_as="zero3", overlap="all", fp16_refusal=_ZERO_FP16),
    "zero1-torch": Strategy("zero_torch", "ZeRO stage 1 with PyTorch's ZeroRedundancyOptimizer and DDP",
                            "optimizer state (whole tensors)", 1, overlap="backward", fp16_refusal=_ZERO_FP16),
    "fsdp": Strategy("fsdp", "FSDP2 fully_shard per block (extra reshard_after_forward: True like ZeRO-3, "
                             "False like ZeRO-2; with --tp: FSDP x TP, 2D; with --ep: a mixture of experts' "
                             "experts cut over ep ranks, each slice sharded over its copies)", _FSDP_SHARDS,
                     3, combines=("tp", "cp", "ep"), estimated_as="fsdp", overlap="all", fp16_refusal=_FSDP_FP16,
                     checkpoints_itself=True, advised=True),  # the package's production ZeRO-3
    # FSDP1's flat parameters are not modelled by the estimator
    "fsdp1": Strategy("fsdp1", "FSDP1 FullyShardedDataParallel with transformer_auto_wrap_policy",
                      _FSDP_SHARDS, 3, overlap="all", fp16_refusal=_FSDP_FP16),
    "deepspeed-zero1": Strategy("deepspeed", "DeepSpeed ZeRO stage 1", "optimizer state", 1,
                                fp16_refusal=_DEEPSPEED_FP16),
    "deepspeed-zero2": Strategy("deepspeed", "DeepSpeed ZeRO stage 2", "optimizer state, gradients", 2,
                                overlap="backward", fp16_refusal=_DEEPSPEED_FP16),
    "deepspeed-zero3": Strategy("deepspeed", "DeepSpeed ZeRO stage 3", _FSDP_SHARDS, 3, overlap="all",
                                fp16_refusal=_DEEPSPEED_FP16),
    "tp-scratch": Strategy("tp_scratch", "tensor parallel from scratch (Megatron): column- and row-parallel "
                                         "linears, heads split, vocabulary-parallel embedding and loss; "
                                         "extra sequence_parallel", _TP_SHARDS,
                           zero_stage=None, spans="tp", estimated_as="tp", fp16_refusal=_TP_FP16),
    "tp": Strategy("tp", "tensor parallel with PyTorch's parallelize_module (Colwise/RowwiseParallel, "
                         "loss_parallel); extra sequence_parallel", _TP_SHARDS,
                   zero_stage=None, spans="tp", estimated_as="tp", fp16_refusal=_TP_FP16, checkpoints_itself=True),
    **{name: Strategy(module, description, "the layers: each rank holds its stage's blocks (and their states)",
                      zero_stage=None, spans="pp", combines=("tp", "dp", "cp") if module == "pp" else (),
                      estimated_as=estimated_as, fp16_refusal=_PP_FP16, checkpoints_itself=module == "pp")
       for name, module, estimated_as, description in [
        ("pp-naive", "pp_scratch", None, "naive model parallelism from scratch: layers cut into stages, one "
                                         "micro-batch through all of them at a time"),
        ("pp-gpipe-scratch", "pp_scratch", "pp-gpipe", "pipeline from scratch, GPipe: all forwards, then all "
                                                       "backwards (micro-batches: grad_accum_steps)"),
        ("pp-1f1b-scratch", "pp_scratch", "pp-1f1b", "pipeline from scratch, 1F1B: one forward, one backward, at "
                                                     "most p micro-batches in flight"),
        ("pp-gpipe", "pp", "pp-gpipe", "torch.distributed.pipelining, ScheduleGPipe"),
        ("pp-1f1b", "pp", "pp-1f1b", "torch.distributed.pipelining, Schedule1F1B (micro-batches >= stages)"),
        ("pp-interleaved", "pp", "pp-interleaved", "torch.distributed.pipelining, ScheduleInterleaved1F1B: 2 stages "
                                                   "per rank"),
        ("pp-zbv", "pp", None, "torch.distributed.pipelining, ScheduleZBVZeroBubble: 2 stages per rank in a V, "
                               "weight gradients deferred into the bubble"),
        ("pp-dualpipev", "pp", None, "torch.distributed.pipelining, ScheduleDualPipeV (DeepSeek): 2 stages per rank "
                                     "in a V"),
    ]},
    "cp-scratch": Strategy("cp_scratch", "context parallel from scratch: every sequence cut over the cp ranks, "
                                       "attention by ring (default), all-gather or Ulysses; zig-zag balanced (with "
                                       "--dp: dp x cp, gradients averaged over both)",
                           "activations: each rank holds its part of every sequence", zero_stage=None, spans="cp",
                           combines=("dp",), estimated_as="cp-scratch", overlap="backward",
                           fp16_refusal=_CP_FP16),
    "cp": Strategy("cp", "context parallel with PyTorch's context_parallel (CUDA GPUs only: it replaces CUDA's "
                         "attention kernels); ring or all-gather, head-tail (with --dp: dp x cp)",
                   "activations: each rank holds its part of every sequence", zero_stage=None, spans="cp",
                   combines=("dp",), overlap="backward", fp16_refusal=_CP_FP16,
                   cuda_only="PyTorch's context_parallel replaces only CUDA attention kernels (flash, "
                             "memory-efficient, cuDNN): on a CPU attention runs "
                             "_scaled_dot_product_flash_attention_for_cpu, which DTensor has no sharding rule for, "
                             "so the first attention raises NotImplementedError; use --strategy cp-scratch, this "
                             "package's context parallelism, which runs on any device"),
    "ep-scratch": Strategy("ep_scratch", "expert parallel from scratch: a mixture of experts' experts cut over the "
                                       "data-parallel ranks (--ep of them share one copy), tokens sent to their "
                                       "experts and back by all-to-all; the rest data parallel (--ep 1: all of it)",
                           "experts: each rank holds ep-th of every MoE layer's experts, and their states",
                           combines=("ep",), estimated_as="ep-scratch", overlap="backward", spans_experts=True,
                           fp16_refusal="its step finishes two sets of gradient all-reduces (dense and experts) and "
                                        "updates in one call, leaving no point at which GradScaler could unscale"),
    "deepspeed-moe": Strategy("deepspeed_moe", "expert parallel with a library: DeepSpeed-MoE's layer (its gate, "
                                             "all-to-all and experts) in every MoE layer, trained by DeepSpeed's "
                                             "engine at ZeRO stage 0 (--ep ranks share one copy of the experts)",
                              "experts: each rank holds ep-th of every MoE layer's experts, and their states",
                              combines=("ep",), spans_experts=True, fp16_refusal=_DEEPSPEED_FP16),
}

# name -> one-line description (what the CLI and the book list)
STRATEGIES = {name: s.description for name, s in STRATEGY_TABLE.items()}
# what each data-parallel strategy shards of the model states, as a ZeRO stage: 1 the
# optimizer state, 2 also the gradients, 3 also the parameters (FSDP, however it reshards)
ZERO_STAGE = {name: s.zero_stage for name, s in STRATEGY_TABLE.items() if s.zero_stage is not None}
SHARDED = [name for name, stage in ZERO_STAGE.items() if stage > 0]
# strategies that run every replica as a thread of one process, not one process each
ONE_PROCESS = tuple(name for name, s in STRATEGY_TABLE.items() if s.one_process or s.spans == "none")
# fp16-mixed (float16 autocast, fp32 weights, loss scaled by torch.amp.GradScaler) is right only
# where one plain GradScaler sees every gradient the optimizer steps with, whole, after any
# all-reduce, and its step can stand in for the strategy's: one device, DDP, DataParallel.
FP16_STRATEGIES = tuple(name for name, s in STRATEGY_TABLE.items() if s.fp16_refusal is None)
# the strategies the estimator models as they are (the names an estimate's Setup takes)
ESTIMATED = tuple(name for name, s in STRATEGY_TABLE.items() if s.estimated_as == name)


def fp16_refusal(strategy: str) -> str:
    """Why `strategy` cannot take fp16-mixed here, and what to use instead."""
    return (f"dtype 'fp16-mixed' (float16 autocast with loss scaling by torch.amp.GradScaler) is supported "
            f"with strategies {', '.join(FP16_STRATEGIES)} only, not {strategy!r}: "
            f"{STRATEGY_TABLE[strategy].fp16_refusal}. Use dtype "
            f"'bf16-mixed' with {strategy!r} (bfloat16 has fp32's exponent range and needs no loss scaling), "
            f"or one of {', '.join(FP16_STRATEGIES)} for fp16")
