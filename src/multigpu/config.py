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

from multigpu.errors import ConfigError
from multigpu.grid import Grid, resolve_grid
from multigpu.strategy_table import (  # noqa: F401 - the table's names, where callers have always found them
    FP16_STRATEGIES,
    ONE_PROCESS,
    SHARDED,
    STRATEGIES,
    STRATEGY_TABLE,
    ZERO_STAGE,
    Strategy,
    fp16_refusal,
)

DTYPES = ("fp32", "bf16-mixed", "fp16-mixed")
MAX_BUCKET_MB = 2**20
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
DEVICES = ("auto", "cpu", "cuda")
DATASETS = ("synthetic", "dummy")


def _choose(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")


def max_cpu_workers() -> int:
    """More CPU processes than this only queue for the cores; we refuse them."""
    return max(8, 4 * (os.cpu_count() or 1))


@dataclass
class RunConfig:
    strategy: str = "single"
    world_size: int = 1  # processes (or, for dp, replicas) = dp x pp x cp x tp
    tp: int = 1  # tensor-parallel degree: ranks that split every layer
    pp: int = 1  # pipeline-parallel degree: stages the layers are cut into
    cp: int = 1  # context-parallel degree: ranks that split every sequence
    dp: int | None = None  # data-parallel degree; None: what world_size leaves after tp and pp
    ep: int | None = None  # expert-parallel degree, inside dp; None: each dp rank its own experts (ep-scratch)
    model: str = "gpt-tiny"  # a preset, or the path of a Hugging Face config.json
    global_batch_size: int = 8  # samples per optimizer step, all ranks together
    grad_accum_steps: int = 1  # micro-batches per optimizer step on each rank
    seq_len: int | None = None  # None: the model preset's default
    dtype: str = "fp32"
    optimizer: str = "sgd"
    lr: float = 0.01
    steps: int = 10
    activation_checkpointing: bool | str = False  # True or "full", "selective" (multigpu.recompute)
    dataset: str = "synthetic"
    dataset_size: int | None = None  # None: about DATASET_TOKENS tokens (num_samples), whatever the steps
    seed: int = 0
    device: str = "auto"
    bucket_cap_mb: float = 25.0  # gradient buckets: DDP, ddp-scratch, zero2, DeepSpeed
    threads_per_worker: int | None = None  # None: the machine's cores split evenly
    track_memory: bool = True  # per-category peak memory from MemTracker (steps 0-1)
    fault: str | None = None  # testing only: "raise@RANK:STEP", "kill@RANK:STEP" or "kill@RANK:STEP:SAVE_STAGE"
    checkpoint_dir: str | None = None  # save the run's state into DIR/step-N (checkpoint.py)
    checkpoint_every: int | None = None  # ... every this many steps (and after the last); None: the last only
    checkpoint_keep: int | None = 2  # the newest complete checkpoints kept; None: all
    checkpoint_async: bool = False  # write in the background while training goes on (DCP's async_save)
    resume: str | None = None  # continue from this checkpoint (a step-N folder, or a checkpoint_dir's newest)
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
    def grid(self) -> Grid:
        """The rank grid (grid.resolve_grid, the one rule): a strategy's own name spans what the
        degrees given leave (`tp --world-size 4` is tp 4; `fsdp --world-size 8 --tp 2` is dp 4 x tp 2)."""
        return resolve_grid(self.strategy, self.world_size, tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp,
                            ep=self.ep)

    @property
    def degrees(self) -> dict[str, int]:
        """{"dp", "pp", "tp"} (and "cp" when the sequence is cut): the rank grid as a dict."""
        return self.grid.as_dict()

    @property
    def process_grid(self) -> Grid:
        """The grid of processes (a one-process strategy's replicas are threads, not ranks)."""
        return Grid() if self.processes == 1 else self.grid

    @property
    def per_rank_batch_size(self) -> int:
        """Samples per data-parallel rank per optimizer step (the ranks of one tensor-, pipeline- or
        context-parallel group share theirs)."""
        return self.global_batch_size // self.degrees["dp"]

    @property
    def micro_batch_size(self) -> int:
        return self.per_rank_batch_size // self.grad_accum_steps

    @property
    def num_samples(self) -> int:
        """The data set's samples: dataset_size, or about DATASET_TOKENS tokens (at least one global batch). It does
        not depend on steps, so a run saved after some steps continues for more on the same data."""
        if self.dataset_size is not None:
            return self.dataset_size
        from multigpu.models import default_seq_len

        return max(self.global_batch_size, -(-DATASET_TOKENS // (self.seq_len or default_seq_len(self.model))))

    def validate(self, on_this_machine: bool = True) -> RunConfig:
        """Check every field, before any process starts. on_this_machine=False: a run planned for other machines
        (a dry run of 1024 ranks): this machine's cores and memory are not its limits."""
        from multigpu.models import PRESETS  # local import: models imports torch

        _choose("strategy", self.strategy, STRATEGIES)
        if self.model not in PRESETS and not self.model.endswith(".json"):
            raise ConfigError(f"unknown model preset {self.model!r}; choose one of: {', '.join(PRESETS)}; "
                              "or give the path of a Hugging Face config.json")
        _choose("dtype", self.dtype, DTYPES)
        _choose("optimizer", self.optimizer, OPTIMIZERS)
        _choose("device", self.device, DEVICES)
        _choose("dataset", self.dataset, DATASETS)
        from multigpu.recompute import recompute_mode

        recompute_mode(self.activation_checkpointing)
        for name in ("world_size", "global_batch_size", "grad_accum_steps", "steps", "dataset_size"):
            value = getattr(self, name)
            if value is None and name == "dataset_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
            if value > MAX_STEPS and name != "dataset_size":  # (a data set is held to this machine's memory)
                raise ConfigError(f"{name} must be at most {MAX_STEPS} (--{name.replace('_', '-')}), got {value}")
        if self.strategy == "single" and self.world_size != 1:
            raise ConfigError(f"strategy 'single' runs one process, got world_size={self.world_size}; "
                              "use world_size=1 or a parallel strategy such as 'ddp'")
        from multigpu.runtime import machine_gpus, resolve_requested

        # a process per GPU is always useful, whatever the cores (a container may show few)
        gpus = 0 if resolve_requested(self.device) == "cpu" else machine_gpus()
        if on_this_machine and self.world_size > max(max_cpu_workers(), gpus):
            raise ConfigError(f"world_size={self.world_size} is more processes than this machine can run usefully "
                              f"({os.cpu_count()} CPU cores, limit {max_cpu_workers()}; {gpus} CUDA GPU(s)); "
                              "use fewer processes or a machine with more GPUs")
        self.grid  # noqa: B018 - resolving the grid checks the degrees, with their arithmetic
        if self.dtype == "fp16-mixed" and self.strategy not in FP16_STRATEGIES:
            raise ConfigError(fp16_refusal(self.strategy))
        dp = self.degrees["dp"]
        per_step = dp * self.grad_accum_steps
        if self.global_batch_size % per_step:
            over = (f"world_size={self.world_size}" if dp == self.world_size
                    else f"dp={dp} data-parallel rank(s)")
            raise ConfigError(f"global_batch_size={self.global_batch_size} does not split evenly over {over} x "
                              f"grad_accum_steps={self.grad_accum_steps} = {per_step} micro-batches; use a multiple "
                              f"of {per_step}, e.g. {per_step * max(1, round(self.global_batch_size / per_step))}")
        if self.num_samples < self.global_batch_size:
            raise ConfigError(f"dataset_size={self.dataset_size} is smaller than one global batch "
                              f"({self.global_batch_size}); use at least {self.global_batch_size} samples")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ConfigError(f"seq_len must be a whole number >= 2, got {self.seq_len!r}")
        from multigpu.models import check_model, max_seq_len

        check_model(self.model)
        if self.seq_len is not None and max_seq_len(self.model) is not None and self.seq_len > max_seq_len(self.model):
            raise ConfigError(f"seq_len={self.seq_len} is longer than model {self.model!r} can take "
                              f"({max_seq_len(self.model)} positions); use at most {max_seq_len(self.model)} or a "
                              "larger preset")
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr):
            raise ConfigError(f"lr must be a finite number (e.g. 0.01), got {self.lr!r}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr!r}")
        if self.lr > MAX_LR:
            raise ConfigError(f"lr must be at most {MAX_LR:g} (--lr; learning rates that train are below 10), got "
                              f"{self.lr:g}")
        if (not isinstance(self.bucket_cap_mb, (int, float)) or not math.isfinite(self.bucket_cap_mb)
                or not 0 < self.bucket_cap_mb <= MAX_BUCKET_MB):
            raise ConfigError(f"bucket_cap_mb must be a positive number of MiB up to {MAX_BUCKET_MB} (1 TiB: one "
                              f"bucket larger than any model), got {self.bucket_cap_mb!r}; DDP's default is 25")
        if self.threads_per_worker is not None and not 1 <= self.threads_per_worker <= MAX_THREADS:
            raise ConfigError(f"threads_per_worker must be a whole number from 1 to {MAX_THREADS} (--threads-per-worker"
                              "; torch.set_num_threads takes a C int; more threads than cores only queue), or left out;"
                              f" got {self.threads_per_worker!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be a whole number from 0 to {MAX_SEED} (torch's generators take a 64-bit "
                              f"signed seed, and the sampler adds the epoch to it), got {self.seed!r}")
        if self.degrees["tp"] > 1:
            from multigpu.models import default_seq_len, tensor_parallel_problems

            seq_len = self.seq_len or default_seq_len(self.model)
            problems = tensor_parallel_problems(self.model, self.degrees["tp"], seq_len,
                                                bool(self.extra.get("sequence_parallel", False)))
            if problems:
                raise ConfigError(f"tp={self.degrees['tp']} cannot split {self.model}: " + "; ".join(problems))
        from multigpu.strategies.cp_scratch import context_problems

        problems = context_problems(self)
        if problems:
            raise ConfigError(f"context parallelism (cp {self.degrees.get('cp', 1)}) with {self.model}: "
                              + "; ".join(problems))
        _check_run_options(self)
        from multigpu.strategies.ep_scratch import expert_problems

        problems = expert_problems(self)
        if problems:
            raise ConfigError(f"{self.model} with strategy {self.strategy!r}: " + "; ".join(problems))
        import importlib

        strategy_module = importlib.import_module(f"multigpu.strategies.{self.info.module}")
        problems = getattr(strategy_module, "config_problems", lambda cfg: [])(self)
        if problems:  # what only the strategy itself knows it cannot do
            raise ConfigError(f"strategy {self.strategy!r}: " + "; ".join(problems))
        _check_checkpointing(self)
        if on_this_machine:
            _check_data_fits(self)
        if self.fault is not None:
            _, fault_rank, _, _ = parse_fault(self.fault)
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
            raise ConfigError(f"unknown RunConfig field(s): {', '.join(unknown)}; "
                              f"known fields are: {', '.join(sorted(names))}")
        return cls(**data)

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)


def with_strategy_defaults(cfg: RunConfig, chosen: set[str] | frozenset = frozenset()) -> tuple[RunConfig, list[str]]:
    """`cfg` with what its strategy needs that the package's defaults do not give, for the fields
    the reader did not choose (`chosen`: names of RunConfig fields given explicitly): a pipeline
    on 4 ranks needs a model with 4 blocks (gpt-tiny has 2) and, for 1F1B, 4 micro-batches. The
    strategy's module says what it needs (its `defaults(cfg)`); the lines returned say what was
    picked and how to choose otherwise. Degrees that cannot tile the world raise ConfigError."""
    import importlib

    cfg.grid  # noqa: B018 - the grid first: what a strategy needs depends on it
    module = importlib.import_module(f"multigpu.strategies.{cfg.info.module}")
    wanted = getattr(module, "defaults", lambda c: {})(cfg)
    changes = {k: v for k, v in wanted.items() if k not in chosen and getattr(cfg, k) != v}
    notes = [f"{cfg.strategy} on {cfg.world_size} processes: {k.replace('_', ' ')} {v} instead of the default "
             f"{getattr(cfg, k)} (give --{k.replace('_', '-')} to choose)" for k, v in changes.items()]
    return cfg.replace(**changes), notes


def parse_fault(fault: str) -> tuple[str, int, int, str | None]:
    """'raise@1:2' -> ('raise', rank 1, step 2, None): fail before step 2. 'kill@1:4:written' -> ('kill', 1, 4,
    'written'): kill rank 1 in the save of the checkpoint after 4 steps, at that stage of it
    (checkpoint.SAVE_STAGES). Used by tests of failure handling; a restarted worker does not fail again."""
    from multigpu.checkpoint import SAVE_STAGES

    try:
        kind, where = fault.split("@")
        rank, step, *stage = where.split(":")
        rank, step, stage = int(rank), int(step), stage[0] if stage else None
        if kind not in ("raise", "kill") or len(where.split(":")) > 3 or stage not in (None, *SAVE_STAGES):
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"fault must look like 'raise@RANK:STEP', 'kill@RANK:STEP' or 'kill@RANK:STEP:STAGE' (STAGE one of "
            f"{', '.join(SAVE_STAGES)}), got {fault!r}"
        ) from None
    return kind, rank, step, stage


MAX_STEPS = 10**9  # steps, samples and checkpoint intervals are counted in 64-bit integers, far from this
MAX_SEED = 2**62  # a 64-bit signed seed, with room for the sampler's seed + epoch
MAX_THREADS = 4096
MAX_LR = 1e6  # far above any rate that trains, far below where an fp32 update overflows (3.4e38)
DATASET_TOKENS = 2**14  # the default data set: about 16,000 tokens, whatever the number of steps (held in every
# process: a larger one shows in the process's memory, beside what the estimator counts)


def _check_data_fits(cfg: RunConfig) -> None:
    """The data set is generated whole in every process, as 64-bit token ids (data.TokenDataset: two streams for a
    decoder, three for T5, and the chain's sequences while they are made): it must fit the machine."""
    from multigpu.models import default_seq_len, family

    streams = 2 if family(cfg.model) != "t5" else 3
    per_process = cfg.num_samples * ((cfg.seq_len or default_seq_len(cfg.model)) + 1) * 8 * (streams + 1)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to compare with
        return
    if per_process * cfg.processes > ram:
        raise ConfigError(f"the data set ({cfg.num_samples:,} samples) takes {per_process / 2**30:,.1f} GiB in each of "
                          f"{cfg.processes} process(es), more than this machine's {ram / 2**30:,.1f} GiB of memory; "
                          "give a smaller --dataset-size (the sampler starts a new epoch when it runs out) or batch")


def _check_checkpointing(cfg: RunConfig) -> None:
    """The checkpoint options: whole numbers in range, a folder that is not another run's."""
    for name, low in (("checkpoint_every", 1), ("checkpoint_keep", 1)):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not low <= value <= MAX_STEPS):
            raise ConfigError(f"{name} must be a whole number from {low} to {MAX_STEPS} (--{name.replace('_', '-')} N, "
                              f"or leave it out), got {value!r}")
    if cfg.resume is not None:  # before any process starts: the checkpoint is there, whole, and fits this run
        from multigpu.checkpoint import CheckpointError, compatibility_problems, read_meta, resolve

        path = resolve(cfg.resume)
        problems = compatibility_problems(read_meta(path), cfg)
        if problems:
            raise CheckpointError(f"cannot continue from {path}: " + "; ".join(problems))
    if cfg.checkpoint_dir is None:
        for name in ("checkpoint_every", "checkpoint_async"):
            if getattr(cfg, name):
                raise ConfigError(f"{name} needs a checkpoint_dir (--checkpoint-dir DIR) to save into")
        return
    from multigpu.checkpoint import complete

    there = complete(cfg.checkpoint_dir)
    resuming_here = cfg.resume is not None and os.path.abspath(cfg.resume) in (
        os.path.abspath(cfg.checkpoint_dir), *(os.path.abspath(p) for p in there))
    from multigpu.runtime import restart_count

    if there and not resuming_here and not restart_count():  # (a restarted worker continues its own run)
        raise ConfigError(f"checkpoint_dir {cfg.checkpoint_dir} already holds checkpoints ({there[-1].name} the "
                          f"newest): continue that run with --resume {cfg.checkpoint_dir}, or choose an empty folder")
    if os.path.exists(cfg.checkpoint_dir) and not os.path.isdir(cfg.checkpoint_dir):
        raise ConfigError(f"checkpoint_dir {cfg.checkpoint_dir} is a file, not a folder")


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


# options of the run itself (not of a strategy) that `extra` carries; train.py applies them
ATTENTION = ("sdpa", "eager")  # how a T5 computes attention: one fused call, or operation by operation


def _check_run_options(cfg: RunConfig) -> None:
    """extra["attention"]: "sdpa" or "eager", T5 only (transformers' own switch; the package's
    GPT always runs SDPA). extra["cuda_memory_cap_bytes"]: the most the process's CUDA caching
    allocator may take from the GPU (torch.cuda.set_per_process_memory_fraction), as on a
    smaller GPU; CUDA runs only."""
    from multigpu.models import family
    from multigpu.profiling import check_option

    check_option(cfg.extra.get("profile"))  # the last step under torch's profiler: true, or a folder for the traces
    attention = cfg.extra.get("attention")
    if attention is not None:
        _choose("attention", attention, ATTENTION)
        if family(cfg.model) != "t5":
            raise ConfigError(f"attention={attention!r} chooses how a T5 computes attention; {cfg.model!r} is not a "
                              "T5 (the package's GPT always runs SDPA): leave attention out")
    cap = cfg.extra.get("cuda_memory_cap_bytes")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ConfigError(f"cuda_memory_cap_bytes must be a whole number of bytes >= 1, got {cap!r}")
        from multigpu.runtime import machine_gpus, resolve_requested

        requested = resolve_requested(cfg.device)
        if requested == "cpu" or (requested == "auto" and machine_gpus() == 0):
            raise ConfigError("cuda_memory_cap_bytes caps the CUDA caching allocator: it needs a run on a CUDA GPU "
                              f"(device={cfg.device!r} runs on the CPU here), or leave it out")
