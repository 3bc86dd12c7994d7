"""RunConfig: everything that defines one training run, checked before any process starts.

A bad value is reported with what was seen and what to do, so a reader never meets a
traceback from deep inside a worker for a typo on the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Strategy:
    """One row of the strategy table: everything the rest of the package may know about a
    strategy without importing it. How it works lives in its module, and nowhere else."""

    module: str  # multigpu.strategies.<module>: its prepare(model, cfg, rt) builds it
    description: str
    shards: str  # what a rank holds a part of, rather than the whole
    zero_stage: int | None = 0  # data parallel: what it shards as a ZeRO stage; None: not data parallel
    spans: str = "dp"  # the grid dimension the strategy's own name spans (dp: one replica per rank)
    combines: tuple[str, ...] = ()  # further grid dimensions it can be given (--tp, --pp)
    one_process: bool = False  # every replica a thread of one process (no process group)


_DP = "nothing: every rank holds the whole model"
STRATEGY_TABLE: dict[str, Strategy] = {
    "single": Strategy("single", "one process, one device: the reference every strategy is tested against",
                       "nothing (one device)", spans="none"),
    "ddp": Strategy("ddp", "PyTorch DistributedDataParallel", _DP),
    "ddp-scratch": Strategy("ddp_scratch", "data parallel from scratch: bucketed all-reduce overlapped with backward "
                                           "(with --tp: over tp-scratch's layers, 2D from scratch)", _DP,
                            combines=("tp",)),
    "dp": Strategy("dp", "DataParallel: one process, one thread per replica (nn.DataParallel on GPUs, "
                         "from scratch on CPU)", _DP, one_process=True),
    "zero1": Strategy("zero", "ZeRO stage 1 from scratch: optimizer state sharded", "optimizer state", 1),
    "zero2": Strategy("zero", "ZeRO stage 2 from scratch: optimizer state and gradients sharded",
                      "optimizer state, gradients", 2),
    "zero3": Strategy("zero", "ZeRO stage 3 from scratch: optimizer state, gradients and parameters sharded",
                      "optimizer state, gradients, parameters", 3),
    "zero1-torch": Strategy("zero_torch", "ZeRO stage 1 with PyTorch's ZeroRedundancyOptimizer and DDP",
                            "optimizer state (whole tensors)", 1),
    "fsdp": Strategy("fsdp", "FSDP2 fully_shard per block (extra reshard_after_forward: True like ZeRO-3, "
                             "False like ZeRO-2; with --tp: FSDP x TP, 2D)", "optimizer state, gradients, parameters",
                     3, combines=("tp",)),
    "fsdp1": Strategy("fsdp1", "FSDP1 FullyShardedDataParallel with transformer_auto_wrap_policy",
                      "optimizer state, gradients, parameters", 3),
    "deepspeed-zero1": Strategy("deepspeed", "DeepSpeed ZeRO stage 1", "optimizer state", 1),
    "deepspeed-zero2": Strategy("deepspeed", "DeepSpeed ZeRO stage 2", "optimizer state, gradients", 2),
    "deepspeed-zero3": Strategy("deepspeed", "DeepSpeed ZeRO stage 3", "optimizer state, gradients, parameters", 3),
    "tp-scratch": Strategy("tp_scratch", "tensor parallel from scratch (Megatron): column- and row-parallel "
                                         "linears, heads split, vocabulary-parallel embedding and loss; "
                                         "extra sequence_parallel", "every weight matrix, by rows or columns; "
                                         "activations inside each block (and between blocks with SP)",
                           zero_stage=None, spans="tp"),
    "tp": Strategy("tp", "tensor parallel with PyTorch's parallelize_module (Colwise/RowwiseParallel, "
                         "loss_parallel); extra sequence_parallel", "every weight matrix, by rows or columns; "
                         "activations inside each block (and between blocks with SP)",
                   zero_stage=None, spans="tp"),
    **{name: Strategy(module, description, "the layers: each rank holds its stage's blocks (and their states)",
                      zero_stage=None, spans="pp", combines=("tp", "dp") if module == "pp" else ())
       for name, module, description in [
        ("pp-naive", "pp_scratch", "naive model parallelism from scratch: layers cut into stages, one "
                                   "micro-batch through all of them at a time"),
        ("pp-gpipe-scratch", "pp_scratch", "pipeline from scratch, GPipe: all forwards, then all backwards "
                                           "(micro-batches: grad_accum_steps)"),
        ("pp-1f1b-scratch", "pp_scratch", "pipeline from scratch, 1F1B: one forward, one backward, at most "
                                          "p micro-batches in flight"),
        ("pp-gpipe", "pp", "torch.distributed.pipelining, ScheduleGPipe"),
        ("pp-1f1b", "pp", "torch.distributed.pipelining, Schedule1F1B (micro-batches >= stages)"),
        ("pp-interleaved", "pp", "torch.distributed.pipelining, ScheduleInterleaved1F1B: 2 stages per rank"),
        ("pp-zbv", "pp", "torch.distributed.pipelining, ScheduleZBVZeroBubble: 2 stages per rank in a V, "
                         "weight gradients deferred into the bubble"),
        ("pp-dualpipev", "pp", "torch.distributed.pipelining, ScheduleDualPipeV (DeepSeek): 2 stages per rank "
                               "in a V"),
    ]},
}
# name -> one-line description (what the CLI and the book list)
STRATEGIES = {name: s.description for name, s in STRATEGY_TABLE.items()}
# what each data-parallel strategy shards of the model states, as a ZeRO stage: 1 the
# optimizer state, 2 also the gradients, 3 also the parameters (FSDP, however it reshards)
ZERO_STAGE = {name: s.zero_stage for name, s in STRATEGY_TABLE.items() if s.zero_stage is not None}
SHARDED = [name for name, stage in ZERO_STAGE.items() if stage > 0]
# strategies that run every replica as a thread of one process, not one process each
ONE_PROCESS = tuple(name for name, s in STRATEGY_TABLE.items() if s.one_process or s.spans == "none")

DTYPES = ("fp32", "bf16-mixed", "fp16-mixed")
# fp16-mixed (float16 autocast, fp32 weights, loss scaled by torch.amp.GradScaler) is right only
# where one plain GradScaler sees every gradient the optimizer steps with, whole, after any
# all-reduce, and its step can stand in for the strategy's: one device, DDP, DataParallel.
FP16_STRATEGIES = ("single", "ddp", "dp")


def _fp16_refusal(strategy: str) -> str:
    """Why `strategy` cannot take fp16-mixed here, and what to use instead."""
    module = STRATEGY_TABLE[strategy].module
    if module in ("fsdp", "fsdp1"):
        why = ("FSDP shards the gradients, so the overflow check must be combined over the ranks: it needs "
               "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which this package does not wire in")
    elif module == "deepspeed":
        why = ("DeepSpeed scales the loss itself, through the fp16 section of its config (a dynamic loss scale "
               "inside the engine), which this package does not set")
    elif module in ("zero", "zero_torch"):
        why = ("each rank's optimizer updates only its shard, so a plain GradScaler checks only that shard "
               "for overflow and one rank could skip a step that another takes")
    elif module == "ddp_scratch":
        why = ("its step finishes the gradient all-reduce and updates in one call, leaving no point at which "
               "GradScaler could unscale and check the averaged gradients")
    elif STRATEGY_TABLE[strategy].spans == "tp":
        why = ("each rank holds a slice of every weight's gradient, so an overflow on one rank must skip the "
               "step on all of them, which a plain GradScaler does not do")
    else:  # pipelines
        why = ("each stage holds only its layers' gradients and the schedule runs backward itself, outside "
               "the loop that scales the loss")
    return (f"dtype 'fp16-mixed' (float16 autocast with loss scaling by torch.amp.GradScaler) is supported "
            f"with strategies {', '.join(FP16_STRATEGIES)} only, not {strategy!r}: {why}. Use dtype "
            f"'bf16-mixed' with {strategy!r} (bfloat16 has fp32's exponent range and needs no loss scaling), "
            f"or one of {', '.join(FP16_STRATEGIES)} for fp16")
MAX_BUCKET_MB = 2**20
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
DEVICES = ("auto", "cpu", "cuda")
DATASETS = ("synthetic", "dummy")


class ConfigError(ValueError):
    """A RunConfig value that cannot work; the message says which and what to do."""


def _choose(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(
            f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}"
        )


def max_cpu_workers() -> int:
    """More CPU processes than this only queue for the cores; we refuse them."""
    return max(8, 4 * (os.cpu_count() or 1))


@dataclass
class RunConfig:
    strategy: str = "single"
    world_size: int = 1  # processes (or, for dp, replicas) = dp x pp x tp
    tp: int = 1  # tensor-parallel degree: ranks that split every layer
    pp: int = 1  # pipeline-parallel degree: stages the layers are cut into
    dp: int | None = None  # data-parallel degree; None: what world_size leaves after tp and pp
    model: str = "gpt-tiny"  # a preset, or the path of a Hugging Face config.json
    global_batch_size: int = 8  # samples per optimizer step, all ranks together
    grad_accum_steps: int = 1  # micro-batches per optimizer step on each rank
    seq_len: int | None = None  # None: the model preset's default
    dtype: str = "fp32"
    optimizer: str = "sgd"
    lr: float = 0.01
    steps: int = 10
    activation_checkpointing: bool = False
    dataset: str = "synthetic"
    dataset_size: int | None = None  # None: enough samples for `steps` steps
    seed: int = 0
    device: str = "auto"
    bucket_cap_mb: float = 25.0  # gradient buckets: DDP, ddp-scratch, zero2, DeepSpeed
    threads_per_worker: int | None = None  # None: the machine's cores split evenly
    track_memory: bool = True  # per-category peak memory from MemTracker (steps 0-1)
    fault: str | None = None  # testing only: "raise@RANK:STEP" or "kill@RANK:STEP"
    extra: dict = field(default_factory=dict)  # strategy-specific options

    # -- derived sizes -------------------------------------------------------------
    @property
    def info(self) -> Strategy:
        return STRATEGY_TABLE[self.strategy]

    @property
    def processes(self) -> int:
        """Worker processes to start: one per replica, except for one-process strategies."""
        return 1 if self.strategy in ONE_PROCESS else self.world_size

    @property
    def degrees(self) -> dict[str, int]:
        """{"dp", "pp", "tp"}: the rank grid. A strategy's own name spans what tp and pp leave
        (`tp --world-size 4` is tp 4; `fsdp --world-size 8 --tp 2` is dp 4 x tp 2)."""
        spans = self.info.spans
        if spans == "none":
            return {"dp": 1, "pp": 1, "tp": 1}
        if spans in ("tp", "pp"):  # a tensor- or pipeline-parallel strategy: data parallel only if given
            other = "pp" if spans == "tp" else "tp"
            given, dp = getattr(self, spans), self.dp or 1
            return {"dp": dp, other: getattr(self, other),
                    spans: self.world_size // (getattr(self, other) * dp) if given == 1 else given}
        return {"dp": self.dp or max(1, self.world_size // (self.tp * self.pp)), "pp": self.pp, "tp": self.tp}

    @property
    def process_degrees(self) -> dict[str, int]:
        """The grid of processes (a one-process strategy's replicas are threads, not ranks)."""
        return {"dp": 1, "pp": 1, "tp": 1} if self.processes == 1 else self.degrees

    @property
    def per_rank_batch_size(self) -> int:
        """Samples per data-parallel rank per optimizer step (the ranks of one tensor- or
        pipeline-parallel group share theirs)."""
        return self.global_batch_size // self.degrees["dp"]

    @property
    def micro_batch_size(self) -> int:
        return self.per_rank_batch_size // self.grad_accum_steps

    @property
    def num_samples(self) -> int:
        return self.dataset_size or self.global_batch_size * max(self.steps, 1)

    def validate(self) -> RunConfig:
        from multigpu.models import PRESETS  # local import: models imports torch

        _choose("strategy", self.strategy, STRATEGIES)
        if self.model not in PRESETS and not self.model.endswith(".json"):
            raise ConfigError(f"unknown model preset {self.model!r}; choose one of: {', '.join(PRESETS)}; "
                              "or give the path of a Hugging Face config.json")
        _choose("dtype", self.dtype, DTYPES)
        _choose("optimizer", self.optimizer, OPTIMIZERS)
        _choose("device", self.device, DEVICES)
        _choose("dataset", self.dataset, DATASETS)
        for name in ("world_size", "global_batch_size", "grad_accum_steps", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.strategy == "single" and self.world_size != 1:
            raise ConfigError(
                f"strategy 'single' runs one process, got world_size={self.world_size}; "
                "use world_size=1 or a parallel strategy such as 'ddp'"
            )
        from multigpu.runtime import machine_gpus, resolve_requested

        # a process per GPU is always useful, whatever the cores (a container may show few)
        gpus = 0 if resolve_requested(self.device) == "cpu" else machine_gpus()
        if self.world_size > max(max_cpu_workers(), gpus):
            raise ConfigError(
                f"world_size={self.world_size} is more processes than this machine can run "
                f"usefully ({os.cpu_count()} CPU cores, limit {max_cpu_workers()}; {gpus} CUDA GPU(s)); "
                "use fewer processes or a machine with more GPUs"
            )
        self._validate_degrees()
        if self.dtype == "fp16-mixed" and self.strategy not in FP16_STRATEGIES:
            raise ConfigError(_fp16_refusal(self.strategy))
        dp = self.degrees["dp"]
        per_step = dp * self.grad_accum_steps
        if self.global_batch_size % per_step:
            over = (f"world_size={self.world_size}" if dp == self.world_size
                    else f"dp={dp} data-parallel rank(s)")
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} does not split evenly over "
                f"{over} x grad_accum_steps={self.grad_accum_steps} "
                f"= {per_step} micro-batches; use a multiple of {per_step}, "
                f"e.g. {per_step * max(1, round(self.global_batch_size / per_step))}"
            )
        if self.num_samples < self.global_batch_size:
            raise ConfigError(
                f"dataset_size={self.dataset_size} is smaller than one global batch "
                f"({self.global_batch_size}); use at least {self.global_batch_size} samples"
            )
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ConfigError(f"seq_len must be a whole number >= 2, got {self.seq_len!r}")
        from multigpu.models import check_model, max_seq_len

        check_model(self.model)
        if self.seq_len is not None and max_seq_len(self.model) is not None and self.seq_len > max_seq_len(self.model):
            raise ConfigError(
                f"seq_len={self.seq_len} is longer than model {self.model!r} can take "
                f"({max_seq_len(self.model)} positions); use at most {max_seq_len(self.model)} or a larger preset"
            )
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr):
            raise ConfigError(f"lr must be a finite number (e.g. 0.01), got {self.lr!r}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr!r}")
        if (not isinstance(self.bucket_cap_mb, (int, float)) or not math.isfinite(self.bucket_cap_mb)
                or not 0 < self.bucket_cap_mb <= MAX_BUCKET_MB):
            raise ConfigError(f"bucket_cap_mb must be a positive number of MiB up to {MAX_BUCKET_MB} (1 TiB: one "
                              f"bucket larger than any model), got {self.bucket_cap_mb!r}; DDP's default is 25")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ConfigError(
                f"threads_per_worker must be >= 1 or None, got {self.threads_per_worker!r}"
            )
        if self.degrees["tp"] > 1:
            from multigpu.models import default_seq_len, tensor_parallel_problems

            seq_len = self.seq_len or default_seq_len(self.model)
            problems = tensor_parallel_problems(self.model, self.degrees["tp"], seq_len,
                                                bool(self.extra.get("sequence_parallel", False)))
            if problems:
                raise ConfigError(f"tp={self.degrees['tp']} cannot split {self.model}: " + "; ".join(problems))
        import importlib

        strategy_module = importlib.import_module(f"multigpu.strategies.{self.info.module}")
        problems = getattr(strategy_module, "config_problems", lambda cfg: [])(self)
        if problems:  # what only the strategy itself knows it cannot do
            raise ConfigError(f"strategy {self.strategy!r}: " + "; ".join(problems))
        if self.fault is not None:
            _, fault_rank, _ = parse_fault(self.fault)
            if fault_rank >= self.processes:
                raise ConfigError(f"fault={self.fault!r} names rank {fault_rank}, but this run has "
                                  f"{self.processes} process(es) (ranks 0 to {self.processes - 1})")
        return self

    def _validate_degrees(self) -> None:
        """The grid must tile the world exactly, and the strategy must know every dimension
        it is given: said with the arithmetic, before any process starts."""
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ConfigError(f"dp must be a whole number >= 1 or None, got {self.dp!r}")
        info, name = self.info, self.strategy
        given = [d for d in ("tp", "pp") if getattr(self, d) > 1 and d != info.spans]
        unknown = [d for d in given if d not in info.combines]
        if unknown:
            can = ", ".join(f"--{d}" for d in info.combines) or "no other degree"
            alone = {"tp": "tensor parallelism: --strategy tp or tp-scratch alone, fsdp or ddp-scratch with --tp "
                           "(2D), a library pipeline (pp-gpipe, pp-1f1b, ...) with --tp",
                     "pp": "pipeline parallelism: a --strategy pp-... (pp-1f1b, pp-gpipe, ...), with --dp N for "
                           "FSDP inside each stage and --tp N for tensor parallel stages"}
            raise ConfigError(f"strategy {name!r} does not combine with {' and '.join(unknown)} "
                              f"({' '.join(f'{d}={getattr(self, d)}' for d in unknown)}); it takes {can}. "
                              f"For {'; for '.join(alone[d] for d in unknown)}")
        if info.spans in ("tp", "pp") and self.dp not in (None, 1) and "dp" not in info.combines:
            kind = "tensor" if info.spans == "tp" else "pipeline"
            raise ConfigError(f"strategy {name!r} is {kind} parallel only: it does not take dp={self.dp}")
        d = self.degrees
        uneven = self.dp is None and self.world_size % (self.tp * self.pp)
        if d["dp"] * d["pp"] * d["tp"] != self.world_size or uneven:
            if self.dp is not None or info.spans in ("tp", "pp"):
                raise ConfigError(f"world size {self.world_size} != dp {d['dp']} x pp {d['pp']} x tp {d['tp']} "
                                  f"= {d['dp'] * d['pp'] * d['tp']}; change --world-size or the degrees")
            raise ConfigError(f"world size {self.world_size} is not a multiple of pp {self.pp} x tp {self.tp} "
                              f"= {self.pp * self.tp}, so no data-parallel degree fills it; use a world size "
                              f"of {self.pp * self.tp}, {2 * self.pp * self.tp}, ...")

    # -- serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown RunConfig field(s): {', '.join(unknown)}; "
                f"known fields are: {', '.join(sorted(names))}"
            )
        return cls(**data)

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)


def parse_fault(fault: str) -> tuple[str, int, int]:
    """'raise@1:2' -> ('raise', rank 1, step 2). Used by tests of failure handling."""
    try:
        kind, where = fault.split("@")
        rank, step = (int(x) for x in where.split(":"))
        if kind not in ("raise", "kill"):
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"fault must look like 'raise@RANK:STEP' or 'kill@RANK:STEP', got {fault!r}"
        ) from None
    return kind, rank, step


# -- amounts of memory, as the command line writes them ------------------------------------

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, allow_zero: bool = False) -> int:
    """'32GiB' -> 34359738368; '80GB' -> 80e9; decimal and binary units, case-insensitive."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if not found or unit not in _BYTE_UNITS:
        raise ConfigError(f"cannot read {text!r} as an amount of memory; write e.g. 32GiB, 80GB or 512MiB")
    value = float(found.group(1)) * _BYTE_UNITS[unit]
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"memory must be {'zero or more' if allow_zero else 'positive'}, got {text!r}")
    return int(value)
