"""Dry runs: one rank of a world this machine could never start, running the package's own strategy code.

A plan for 1024 GPUs is usually checked with formulas (the estimator), then on the GPUs themselves, by the
hour. Between the two, PyTorch 2.13 offers two stand-ins that hold no memory and need no peers:

- the `fake` process-group backend (`torch.testing._internal.distributed.fake_pg`): a group of any size in
  which this process is rank r, and whose collectives return at once without sending anything;
- `FakeTensorMode`: tensors with a shape, a dtype and a device but no memory behind them; every operator
  computes its output's shape and nothing else.

Under both, `dry_run` builds the model at its full size, hands it to the strategy's own `prepare` (the same
code a real run calls), and runs two training steps (forward, backward, the optimizer's update): the first
makes what a strategy makes once (the optimizer's state, its buffers), the second is measured. On that rank:

- the model states it keeps between steps, by category, counted from the tensors the strategy really made
  (`memory.model_state_bytes`: a DTensor's local shard, a flat buffer once);
- the activations the step's first micro-batch leaves for backward, at the end of its forward (weights a
  collective gathered counted apart); under a pipeline's schedule, the most alive at the end of any forward;
- every collective the strategy issued (the package's `CommCounter`), with its group's size and payload;
- the seconds it took on this CPU.

What a dry run cannot tell: time on a GPU (nothing computes), NCCL's behaviour (nothing is sent), the caching
allocator's fragmentation, and whether a CPU tensor was handed to NCCL (the fake backend checks no devices:
`tests/test_gpu_path.py` does). Which strategies cannot run this way, and why, is `CANNOT`.

`materialize` ("cpu" or "cuda"; `dryrun --materialize`) runs the same rank with real tensors on that device
and the fake group still (torchtitan's "fake backend" dry run): the rank's own kernels really compute (on
what the collectives leave in their buffers: unsent, so the values mean nothing, only the memory and the
time do), and on a GPU the CUDA allocator's peak of the measured step is recorded beside the counts. The
model is built whole on the host first and handed to the strategy, as a real run does, so the whole model
must fit in the host's memory.
"""

from __future__ import annotations

import resource
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from multigpu.comm import OP_KINDS, CommCounter
from multigpu.config import RunConfig
from multigpu.errors import ConfigError
from multigpu.strategy_table import STRATEGIES

# strategy -> why it cannot run on fake tensors and a fake group (the others all can)
CANNOT = {
    "single": "one process, no group: its estimate is already checked against real runs",
    "dp": "DataParallel drives replicas on GPUs from one process: it has no process group to fake",
    "ddp": "DDP's C++ reducer reads every parameter's memory when it is built (_verify_params_across_processes), "
           "which a fake tensor does not have; ddp-scratch issues the same bucketed all-reduces",
    "zero1-torch": "it wraps the model in DDP (see ddp)",
    "deepspeed-zero1": "DeepSpeed's engine allocates its flat buffers on its accelerator, outside PyTorch's modes",
    "deepspeed-zero2": "DeepSpeed's engine allocates its flat buffers on its accelerator, outside PyTorch's modes",
    "deepspeed-zero3": "DeepSpeed's engine allocates its flat buffers on its accelerator, outside PyTorch's modes",
    "deepspeed-moe": "DeepSpeed's engine allocates its flat buffers on its accelerator, outside PyTorch's modes",
    "cp": "PyTorch's context parallelism dispatches CUDA attention kernels only",
    "ep-scratch": "how many tokens go to each rank's experts is read from the router's counts, which a fake tensor "
                  "does not hold and a fake group does not send",
    "pp-gpipe": "torch.distributed.pipelining infers each stage's shapes by sending them between ranks, and a fake "
                "group delivers nothing; pp-gpipe-scratch runs the same schedule",
    "pp-1f1b": "as pp-gpipe; pp-1f1b-scratch runs the same schedule",
    "pp-interleaved": "as pp-gpipe (the library's pipelines)",
    "pp-zbv": "as pp-gpipe (the library's pipelines)",
    "pp-dualpipev": "as pp-gpipe (the library's pipelines)",
    "fsdp --ep": "as ep-scratch (fsdp cuts the experts with the same dispatch)",
}
# the largest plan a dry run takes: its fake group and meshes keep a map of every rank, and each micro-batch of
# the step runs (Llama 3 405B trained on 16,384 GPUs; a micro-batch of 16 x 8,192 tokens per GPU)
MAX_WORLD = 2**14
MAX_MICRO_BATCHES = 64
MAX_MICRO_TOKENS = 2**24


@dataclass
class DryRun:
    """What one rank measured in one dry-run step."""

    model: str
    strategy: str
    world_size: int
    degrees: dict  # pp, dp, cp, tp (and ep)
    rank: int
    coords: dict  # this rank's place along each dimension
    role: str  # "every rank" or its pipeline stage: "first stage", "middle stage", "last stage"
    micro_batch: int  # samples per micro-batch on this rank
    seq_len: int
    grad_accum_steps: int
    model_states: dict  # params, grads, optimizer: bytes kept between steps
    # activations alive at the end of the first micro-batch's forward; under a pipeline's schedule, the most alive
    # at the end of any forward (its micro-batches in flight)
    forward_saved: int | None
    forward_gathered: int | None  # weights a collective gathered still alive then (FSDP's, ZeRO-3's)
    collectives: list  # {"kind", "group_size", "calls", "payload_bytes"}, by kind and group size
    seconds: float
    max_rss_bytes: int  # this process's resident peak so far (the fake tensors hold none)
    materialized: str | None = None  # the device of the real tensors, or None (fake tensors)
    # the CUDA allocator's peak during the measured step (materialized on a GPU), else None
    allocator_peak_bytes: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def plan(strategy: str, world_size: int, model: str, **options) -> RunConfig:
    """A RunConfig for a world this machine does not have, checked as a real run's is (the grid's arithmetic,
    the model's cuts), but not against this machine's cores and memory. The global batch defaults to one sample
    per data-parallel rank and micro-batch."""
    refuse_world(strategy, world_size)
    cfg = RunConfig(strategy=strategy, world_size=world_size, model=model, **options)
    if "global_batch_size" not in options:
        cfg.global_batch_size = cfg.grid.dp * cfg.grad_accum_steps
    if "optimizer" not in options:
        cfg.optimizer = "adamw"
    refuse(cfg.validate(on_this_machine=False))
    return cfg


def refuse_world(strategy: str, world_size: int | None) -> None:
    """A ConfigError if `strategy` cannot be dry-run (`CANNOT`) or the world is larger than `MAX_WORLD`."""
    if strategy in CANNOT:
        runs = ", ".join(s for s in STRATEGIES if s not in CANNOT)
        raise ConfigError(f"strategy {strategy!r} cannot be dry-run: {CANNOT[strategy]}. Those that can: {runs}")
    if isinstance(world_size, int) and world_size > MAX_WORLD:
        raise ConfigError(f"a dry run plans at most {MAX_WORLD:,} ranks (--world-size; Llama 3 405B trained on "
                          f"16,384 GPUs): its fake group and meshes keep a map of every rank, so a larger world takes "
                          f"minutes and gigabytes of this machine's memory; got {world_size:,}")


def refuse(cfg: RunConfig) -> None:
    """A ConfigError saying why a validated `cfg` cannot be dry-run (`refuse_world`, its micro-batches), if so."""
    from multigpu.models import default_seq_len

    refuse_world(cfg.strategy, cfg.world_size)
    if cfg.grad_accum_steps > MAX_MICRO_BATCHES:
        raise ConfigError(f"a dry run executes each micro-batch of its step: give at most {MAX_MICRO_BATCHES} "
                          f"(--grad-accum-steps; each holds and sends what the first does), got {cfg.grad_accum_steps}")
    tokens = cfg.micro_batch_size * (cfg.seq_len or default_seq_len(cfg.model))
    if tokens > MAX_MICRO_TOKENS:
        raise ConfigError(f"a micro-batch of {cfg.micro_batch_size:,} samples is {tokens:,} tokens per rank, more than "
                          f"the {MAX_MICRO_TOKENS:,} a dry run takes; give a smaller --global-batch-size or more "
                          "--grad-accum-steps")
    if cfg.strategy == "fsdp" and cfg.grid.ep > 1:
        raise ConfigError(f"fsdp --ep {cfg.grid.ep} cannot be dry-run: {CANNOT['ep-scratch']}; fsdp --ep 1 "
                          "(the experts whole on every rank) can")


def roles(cfg: RunConfig) -> dict[str, int]:
    """The ranks whose shares differ, by role: a pipeline's first, middle and last stage (each at data-parallel,
    context and tensor rank 0); every other grid holds the same amount on every rank (rank 0)."""
    pp = cfg.grid.pp
    if pp == 1:
        return {"every rank": 0}
    stride = cfg.processes // pp
    stages = {"first stage": 0, "middle stage": pp // 2, "last stage": pp - 1}
    return {role: s * stride for role, s in stages.items() if pp > 2 or role != "middle stage"}


def dry_runs(cfg: RunConfig, materialize: str | None = None) -> list[DryRun]:
    """`dry_run` of every distinct role (`roles`)."""
    return [dry_run(cfg, rank, role, materialize) for role, rank in roles(cfg).items()]


def materialize_problem(cfg: RunConfig, device: str) -> str | None:
    """Why `cfg` cannot run with real tensors on `device` here, or None: the whole model is built on the host
    first (fp32), and a GPU must be there."""
    from multigpu.estimator.model_trace import model_shape

    if device not in ("cpu", "cuda"):
        return f"--materialize takes cpu or cuda, got {device!r}"
    if device == "cuda" and not torch.cuda.is_available():
        return "--materialize cuda: this machine has no CUDA GPU; use --materialize cpu, or leave it out"
    whole = model_shape(cfg.model).parameters * 4
    free = _available_host_bytes()
    if free is not None and whole > free // 2:
        return (f"--materialize builds {cfg.model} whole on the host first ({whole / 2**30:.1f} GiB in fp32), more "
                f"than half of this machine's available memory ({free / 2**30:.1f} GiB); dry-run it without "
                "--materialize, or give a smaller model")
    return None


def materialize_device(cfg: RunConfig, asked: str | None) -> str | None:
    """The device `--materialize` asks for ("auto": cuda where there is a GPU), checked; None: fake tensors."""
    if asked is None:
        return None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if asked == "auto" else asked
    if why := materialize_problem(cfg, device):
        raise ConfigError(why)
    return device


def materialized_line(run: DryRun) -> str:
    """A materialized dry run's line: its device, its seconds, the CUDA allocator's peak where there is one."""
    peak = (f"; the CUDA allocator's peak in the step {run.allocator_peak_bytes / 2**20:,.1f} MiB"
            if run.allocator_peak_bytes is not None else "")
    return f"{run.role}: real tensors on {run.materialized}, {run.seconds:.1f} s{peak}"


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def dry_run(cfg: RunConfig, rank: int = 0, role: str = "every rank", materialize: str | None = None) -> DryRun:
    """One step of `cfg` (from `plan`) as rank `rank` of its world, on fake tensors and a fake group; with
    `materialize` ("cpu", "cuda"), on real tensors on that device and the fake group."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from multigpu import moe, strategies
    from multigpu.data import TokenDataset
    from multigpu.memory import model_state_bytes
    from multigpu.models import build_model, default_seq_len, vocab_size
    from multigpu.runtime import RankGrid, Runtime

    world = cfg.processes
    if materialize is not None and (why := materialize_problem(cfg, materialize)):
        raise ConfigError(why)
    device = torch.device("cuda", torch.cuda.current_device()) if materialize == "cuda" else torch.device("cpu")
    on_gpu = device.type == "cuda"
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not in a world of {world} (ranks 0 to {world - 1})")
    if dist.is_initialized():
        raise ConfigError("a dry run makes its own (fake) process group; this process already has one: "
                          "run it outside a training process")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        rt = Runtime(rank, 0, world, device, "fake")
        rt.grid = RankGrid.build(device.type, cfg.process_grid)
        for dim in rt.grid.sizes:  # the mesh and its groups: made from real tensors, before the fake mode
            rt.grid.group(dim)
        seq_len = cfg.seq_len or default_seq_len(cfg.model)
        micro = cfg.micro_batch_size
        fake = FakeTensorMode(allow_non_fake_inputs=True) if materialize is None else nullcontext()
        with fake, _mesh_bookkeeping_on_real_tensors(), moe.even_routing(), warnings.catch_warnings():
            # FSDP2 warns that a T5 block returns a view, on which an in-place op would skip its all-gather; none
            # follows here: `check --strategy fsdp --model t5-tiny` trains as one device does (within 6e-8)
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            model = build_model(cfg.model, cfg.seed)
            if materialize is not None:
                model.to(device)
            moe.configure(model, cfg.extra)
            par = strategies.prepare(model, cfg, rt)
            del model
            # one micro-batch of random ids, laid out as the training loop's loader makes it (the data set's streams,
            # T5's decoder inputs too, each a tensor of its own, as collated), used for every micro-batch
            data = TokenDataset(cfg.model, "dummy", micro, seq_len, vocab_size(cfg.model), cfg.seed)
            batches = [{k: v.clone().to(device) if materialize else v.clone() for k, v in data.tensors.items()}
                       ] * cfg.grad_accum_steps
            autocast = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(cfg.dtype)
            par.run_step(batches, autocast)  # the first step makes what is made once (optimizer state, buffers)
            tracker = _NewStorages({t.untyped_storage()._cdata for t in _tensors(par)})
            forward, before = {}, set()  # before: what the step made ahead of its first forward (a zeroed buffer)

            def at_forward(i):
                if i == 0:
                    before.update(k for k, (ref, _) in tracker.refs.items() if not ref.expired())

            def after_forward(*_):  # a pipeline: the most its schedule holds at once, at the end of each forward
                now = _alive(tracker, skip=_storages_of_grads(par))
                if now["computed"] > forward.get("computed", -1):
                    forward.update(now)

            if par.train_step is None:  # the plain step: its first backward call is the end of a forward
                backward = par.backward

                def first_backward(loss):
                    if not forward:
                        forward.update(_alive(tracker, skip=before | _storages_of_grads(par)))
                    return backward(loss)
                par.backward = first_backward
            hook = par.module.register_forward_hook(after_forward) if par.train_step else None
            if on_gpu:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            with tracker, CommCounter(world) as comm:
                par.run_step(batches, autocast, at_forward)
            allocator_peak = torch.cuda.max_memory_allocated(device) if on_gpu else None
            if hook:
                hook.remove()
            states = model_state_bytes(par.module, par.optimizer)
    except MemoryError:
        raise ConfigError(f"the dry run of {cfg.strategy} on {world} ranks ran out of this machine's memory "
                          f"(resident peak {_max_rss() / 2**30:.1f} GiB); "
                          + ("fake tensors hold none, so a smaller model or fewer layers is what shrinks it"
                             if materialize is None else "without --materialize its tensors hold none")) from None
    finally:
        dist.destroy_process_group()
    by_group = defaultdict(lambda: [0, 0])
    for (kind, payload), size in zip(comm.log, comm.group_sizes, strict=True):
        by_group[kind, size][0] += 1
        by_group[kind, size][1] += payload
    collectives = [{"kind": k, "group_size": g, "calls": c, "payload_bytes": b}
                   for (k, g), (c, b) in sorted(by_group.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))]
    return DryRun(cfg.model, cfg.strategy, world, cfg.degrees, rank,
                  {d: rt.grid.coord(d) for d in rt.grid.sizes}, role, micro, seq_len, cfg.grad_accum_steps,
                  states, forward.get("computed"), forward.get("gathered"), collectives,
                  time.perf_counter() - start, _max_rss(), materialize, allocator_peak)


def _tensors(par) -> list[torch.Tensor]:
    """Every tensor the strategy holds before the step: its parameters, buffers and optimizer state."""
    from torch.distributed.tensor import DTensor

    found = [*par.module.parameters(), *par.module.buffers(), *par.tracked]
    found += [v for s in par.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [t.to_local() if isinstance(t, DTensor) else t for t in found if isinstance(t, torch.Tensor)]


class _NewStorages(TorchDispatchMode):
    """Every storage an operator makes during the step (outside `held`), and whether an all-gather made it."""

    def __init__(self, held: set):
        super().__init__()
        self.held, self.refs = held, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        # an all-gather's output holds weights (FSDP's, ZeRO-3's); what a pipeline stage receives is an activation
        gathers = func.namespace in ("c10d", "_c10d_functional") and OP_KINDS.get(func._opname) == "all_gather"
        made_by = "gathered" if gathers else "computed"
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not hasattr(t, "_local_tensor"):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.held and (key not in self.refs or self.refs[key][0].expired()):
                    self.refs[key] = (StorageWeakRef(storage), made_by)
        if gathers:  # the output passed in (all_gather_into_tensor)
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self.refs:
                    self.refs[t.untyped_storage()._cdata] = (self.refs[t.untyped_storage()._cdata][0], "gathered")
        return out


def _storages_of_grads(par) -> set:
    """The storages of the gradients the strategy holds now (a flat buffer made at the step's start: ZeRO-1's)."""
    grads = [p.grad for p in par.module.parameters() if p.grad is not None] + list(par.tracked)
    return {(g.to_local() if hasattr(g, "to_local") else g).untyped_storage()._cdata for g in grads
            if isinstance(g, torch.Tensor)}


def _alive(tracker: _NewStorages, skip: set) -> dict[str, int]:
    """Bytes of the step's storages alive now (outside `skip`), by who made them, at their size now (FSDP frees
    an unsharded weight by resizing its storage to nothing)."""
    out = {"computed": 0, "gathered": 0}
    for key, (ref, made_by) in tracker.refs.items():
        if key not in skip and not ref.expired():
            out[made_by] += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
    return out


@contextmanager
def _mesh_bookkeeping_on_real_tensors():
    """DeviceMesh finds a rank's coordinates with tensor operations on its rank map (`arange`, `nonzero`,
    `tolist`), which under FakeTensorMode become fake and hold no answer; FSDP2 makes such meshes while it
    shards a tensor-parallel model, and HSDP and expert parallelism make their own. Inside this context they
    are computed on real tensors, as in a real run (the map is one integer per rank)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import device_mesh

    init, make = device_mesh.DeviceMesh.__init__, device_mesh.init_device_mesh

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_make(*args, **kwargs):
        with unset_fake_temporarily():
            return make(*args, **kwargs)

    device_mesh.DeviceMesh.__init__, device_mesh.init_device_mesh = real_init, real_make
    try:
        yield
    finally:
        device_mesh.DeviceMesh.__init__, device_mesh.init_device_mesh = init, make


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
