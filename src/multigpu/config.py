"""RunConfig: everything that defines one training run, checked before any process starts.

A bad value is reported with what was seen and what to do, so a reader never meets a
traceback from deep inside a worker for a typo on the command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

STRATEGIES = {
    "single": "one process, one device: the reference every strategy is tested against",
    "ddp": "PyTorch DistributedDataParallel",
    "ddp-scratch": "data parallel from scratch: bucketed all-reduce overlapped with backward",
    "dp": "DataParallel: one process, one thread per replica (nn.DataParallel on GPUs, from scratch on CPU)",
    "zero1": "ZeRO stage 1 from scratch: optimizer state sharded",
    "zero2": "ZeRO stage 2 from scratch: optimizer state and gradients sharded",
    "zero3": "ZeRO stage 3 from scratch: optimizer state, gradients and parameters sharded",
    "zero1-torch": "ZeRO stage 1 with PyTorch's ZeroRedundancyOptimizer and DDP",
    "fsdp": "FSDP2 fully_shard per block (extra reshard_after_forward: True like ZeRO-3, False like ZeRO-2)",
    "fsdp1": "FSDP1 FullyShardedDataParallel with transformer_auto_wrap_policy",
    "deepspeed-zero1": "DeepSpeed ZeRO stage 1",
    "deepspeed-zero2": "DeepSpeed ZeRO stage 2",
    "deepspeed-zero3": "DeepSpeed ZeRO stage 3",
}
# what each strategy shards of the model states, as a ZeRO stage: 1 the optimizer state,
# 2 also the gradients, 3 also the parameters (FSDP, however it reshards)
ZERO_STAGE = {"single": 0, "ddp": 0, "ddp-scratch": 0, "dp": 0,
              "zero1": 1, "zero1-torch": 1, "deepspeed-zero1": 1,
              "zero2": 2, "deepspeed-zero2": 2,
              "zero3": 3, "deepspeed-zero3": 3, "fsdp": 3, "fsdp1": 3}
SHARDED = [s for s in STRATEGIES if ZERO_STAGE[s] > 0]
# strategies that run every replica as a thread of one process, not one process each
ONE_PROCESS = ("single", "dp")
DTYPES = ("fp32", "bf16-mixed")
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
    world_size: int = 1
    model: str = "gpt-tiny"
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
    def processes(self) -> int:
        """Worker processes to start: one per replica, except for one-process strategies."""
        return 1 if self.strategy in ONE_PROCESS else self.world_size

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def micro_batch_size(self) -> int:
        return self.per_rank_batch_size // self.grad_accum_steps

    @property
    def num_samples(self) -> int:
        return self.dataset_size or self.global_batch_size * max(self.steps, 1)

    def validate(self) -> RunConfig:
        from multigpu.models import PRESETS  # local import: models imports torch

        _choose("strategy", self.strategy, STRATEGIES)
        _choose("model preset", self.model, PRESETS)
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
        if self.world_size > max_cpu_workers():
            raise ConfigError(
                f"world_size={self.world_size} is more processes than this machine can run "
                f"usefully ({os.cpu_count()} CPU cores, limit {max_cpu_workers()}); "
                "use fewer processes or a machine with more GPUs"
            )
        per_step = self.world_size * self.grad_accum_steps
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} does not split evenly over "
                f"world_size={self.world_size} x grad_accum_steps={self.grad_accum_steps} "
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
        from multigpu.models import max_seq_len

        if self.seq_len is not None and max_seq_len(self.model) is not None and self.seq_len > max_seq_len(self.model):
            raise ConfigError(
                f"seq_len={self.seq_len} is longer than model {self.model!r} can take "
                f"({max_seq_len(self.model)} positions); use at most {max_seq_len(self.model)} or a larger preset"
            )
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr!r}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb!r}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ConfigError(
                f"threads_per_worker must be >= 1 or None, got {self.threads_per_worker!r}"
            )
        if self.fault is not None:
            _, fault_rank, _ = parse_fault(self.fault)
            if fault_rank >= self.processes:
                raise ConfigError(f"fault={self.fault!r} names rank {fault_rank}, but this run has "
                                  f"{self.processes} process(es) (ranks 0 to {self.processes - 1})")
        return self

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
