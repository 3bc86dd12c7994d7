"""Which strategy: the sources' decision guide, then the numbers.

1. The guide (`GUIDE`, quoted from Hugging Face's "Efficient Training on Multiple GPUs",
   section "Which Strategy To Use When", after the ZeRO and Megatron papers) names, for each
   case, strategies in order, "the first on the list typically faster".
2. `plans` lists every way the package can run the model on the machine: the data-parallel
   family (ddp, zero1, zero2, fsdp), and for the package's GPT tensor parallelism (tp alone,
   fsdp with tp: 2D) within a node, context parallelism (fsdp with cp: the sequence cut over
   the ranks of a node) and pipelines (pp-1f1b, pp-interleaved) with tensor- and data-parallel
   ranks inside each stage (PP x TP, PP x FSDP, 3D). For each grid, every
   split of the global batch into micro-batches is tried; a plan fits if the estimator's
   peak per GPU (`multigpu.estimator.peak`, the most loaded pipeline rank) is within the GPU's
   memory, and is timed by the step model of `multigpu.estimator.step_time`.
3. `advise` recommends the fastest plan that fits, says which case of the guide applies and
   what the guide recommends there, and whether the numbers agree.

Every number in the advice is the estimator's or the step model's: estimates, not
measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from multigpu.errors import ConfigError
from multigpu.estimator.machines import MACHINES, Machine, describe, generic_machine
from multigpu.estimator.model_trace import gpt_parts, model_shape
from multigpu.estimator.peak import Estimate, estimate
from multigpu.estimator.question import PIPELINES, Setup, cublas_workspace_bytes
from multigpu.estimator.step_time import StepTime, step_time
from multigpu.strategy_table import STRATEGY_TABLE

# case -> (the guide's words for it, the families it names, first typically faster)
GUIDE = {
    "fits on one GPU": (
        "Model fits onto a single GPU: 1. DDP - Distributed DP; 2. ZeRO - may or may not be faster depending on "
        "the situation and configuration used", ("DDP", "ZeRO")),
    "does not fit on one GPU": (
        "Model doesn't fit onto a single GPU: 1. PP; 2. ZeRO; 3. TP. With very fast intra-node connectivity of "
        "NVLINK or NVSwitch all three should be mostly on par, without these PP will be faster than TP or ZeRO. "
        "[...] TP is almost always used within a single node", ("PP", "ZeRO", "TP")),
    "largest layer does not fit on one GPU": (
        "Largest Layer not fitting into a single GPU: 1. If not using ZeRO - must use TP, as PP alone won't be "
        "able to fit. 2. With ZeRO see the same entry for \"Single GPU\" above", ("TP", "ZeRO")),
    "several nodes, fast links": (
        "Multi-Node / Multi-GPU, when you have fast inter-node connectivity: 1. ZeRO - as it requires close to no "
        "modifications to the model; 2. PP+TP+DP - less communications, but requires massive changes to the model",
        ("ZeRO", "PP+TP+DP")),
    "several nodes, slow links": (
        "Multi-Node / Multi-GPU, when you have slow inter-node connectivity and still low on GPU memory: "
        "DP+PP+TP+ZeRO-1", ("PP+TP+DP",)),
}
GUIDE_SOURCE = "Hugging Face, Efficient Training on Multiple GPUs, \"Which Strategy To Use When\""
# the guide's names, as sets of plans: its "PP" is any pipeline, its "TP" tensor parallelism with
# or without ZeRO across the replicas
GUIDE_NAMES = {"DDP": ("DDP",), "ZeRO": ("ZeRO",), "TP": ("TP", "ZeRO+TP"),
               "PP": ("PP", "PP+DP", "PP+TP", "PP+TP+DP"), "PP+TP+DP": ("PP+TP+DP",)}

MAX_GPUS = 2**20  # the advice's machines: far beyond any built, small enough that their grids are listed at once
MAX_GLOBAL_BATCH = 2**30  # samples per step: beyond any published run's batch by orders of magnitude

# the data-parallel plans weighed (the strategy table's `advised`: ddp, zero1, zero2 and fsdp, the
# package's production ZeRO-3)
ADVISED = tuple(name for name, s in STRATEGY_TABLE.items() if s.advised)
# what a plan changes in the model and sends, least first: the order among plans equally fast
SIMPLEST_FIRST = ("DDP", "ZeRO", "EP", "EP+DP", "ZeRO+EP", "TP", "ZeRO+TP", "ZeRO+CP", "PP", "PP+DP", "PP+TP",
                  "PP+TP+DP")


@dataclass(frozen=True)
class Plan:
    """One way to run a step: a strategy on a grid, a split into micro-batches, its peak
    memory per GPU and its time per step (both estimates)."""

    setup: Setup
    global_batch: int
    memory: Estimate
    time: StepTime
    memory_bytes: int  # what one GPU has

    @property
    def fits(self) -> bool:
        return self.memory.per_rank_bytes["total"] <= self.memory_bytes

    @property
    def degrees(self) -> dict[str, int]:
        return self.setup.grid.as_dict()

    @property
    def family(self) -> str:
        """The guide's name for it: DDP, ZeRO, TP, PP and their combinations."""
        d, s = self.degrees, self.setup.strategy
        if s in PIPELINES:
            return "PP" + ("+TP" if d["tp"] > 1 else "") + ("+DP" if d["dp"] > 1 else "")
        if d["tp"] > 1:
            return "ZeRO+TP" if d["dp"] > 1 else "TP"
        if d.get("cp", 1) > 1:
            return "ZeRO+CP"
        if s == "ep-scratch":  # a mixture of experts: its experts cut over ep of the data-parallel ranks
            return "DDP" if d.get("ep", 1) == 1 else "EP" if d["ep"] == d["dp"] else "EP+DP"
        if d.get("ep", 1) > 1:
            return "ZeRO+EP"
        return "DDP" if s == "ddp" else "ZeRO"

    @property
    def label(self) -> str:
        """The strategy as the package names it, with its degrees: `pp-1f1b --tp 8 --dp 2`."""
        d, s = self.degrees, self.setup.strategy
        if s in PIPELINES:
            return s + "".join(f" --{k} {d[k]}" for k in ("pp", "tp", "dp") if d[k] > 1)
        return s + (f" --tp {d['tp']}" if d["tp"] > 1 and s != "tp" else "") + (
            f" --cp {d['cp']}" if d.get("cp", 1) > 1 else "") + (
            f" --ep {d.get('ep', 1)}" if s == "ep-scratch" or d.get("ep", 1) > 1 else "")

    @property
    def command(self) -> str:
        """The run that trains this plan (on a machine that has the GPUs)."""
        m = self.setup.grad_accum_steps
        return (f"python -m multigpu run --strategy {self.label} --world-size {self.setup.world_size} "
                f"--model {self.setup.model} --seq-len {self.setup.seq_len} --dtype {self.setup.dtype} "
                f"--optimizer {self.setup.optimizer} --global-batch-size {self.global_batch}"
                + (f" --grad-accum-steps {m}" if m > 1 else ""))

    def summary(self) -> str:
        t, gib = self.time, self.memory.per_rank_bytes["total"] / 2**30
        parts = [f"compute {t.compute_s:.3g}"]
        parts += [f"{k.upper()} collectives {v:.3g} not hidden" for k, v in t.exposed_s.items() if v > 0]
        if t.bubble_s:
            parts.append(f"bubble {t.bubble_s:.3g}")
        m = self.setup.grad_accum_steps
        return (f"{self.label}: {gib:.1f} GiB per GPU, {t.total_s:.3g} s per step ({', '.join(parts)}), "
                f"{m} micro-batch{'es' if m > 1 else ''} of {self.memory.per_rank_batch}")

    def as_dict(self) -> dict:
        return {"strategy": self.setup.strategy, "label": self.label, "family": self.family, **self.degrees,
                "micro_batches": self.setup.grad_accum_steps, "micro_batch_size": self.memory.per_rank_batch,
                "per_gpu_bytes": self.memory.per_rank_bytes["total"], "fits": self.fits,
                "step": self.time.as_dict(), "command": self.command}


@dataclass
class Advice:
    strategy: str  # the recommended plan's strategy, or "does not fit"
    plan: Plan | None
    case: str  # the guide's case that applies
    reasons: list[str]
    agrees: bool | None  # whether the numbers put the guide's first choice first
    plans: list[Plan] = field(default_factory=list)  # the best plan of every grid that fits, fastest first
    too_big: list[Plan] = field(default_factory=list)  # the grids that fit no split, least memory first
    machine: Machine | None = None
    global_batch: int = 0

    @property
    def per_gpu_bytes(self) -> int | None:
        return self.plan.memory.per_rank_bytes["total"] if self.plan else None

    def best_of(self, name: str) -> Plan | None:
        """The fastest plan that fits of a family (DDP, ZeRO, TP, ZeRO+TP, PP, PP+DP, PP+TP,
        PP+TP+DP) or of one of the guide's names (`GUIDE_NAMES`)."""
        return next((p for p in self.plans if p.family in GUIDE_NAMES.get(name, (name,))), None)

    def by_family(self) -> list[dict]:
        """One row per family (DDP, ZeRO, TP, ZeRO+TP, PP, PP+DP, PP+TP, PP+TP+DP): its fastest
        plan that fits, or else the one closest to fitting; fastest first."""
        rows = []
        for family in SIMPLEST_FIRST:
            plan = next((p for p in self.plans + self.too_big if p.family == family), None)
            if plan is None:
                continue
            t = plan.time
            rows.append({"family": family, "plan": plan.label, "micro-batches": plan.setup.grad_accum_steps,
                         "GiB per GPU": plan.memory.per_rank_bytes["total"] / 2**30, "fits": plan.fits,
                         "s per step": t.total_s, "compute (s)": t.compute_s,
                         "collectives not hidden (s)": sum(t.exposed_s.values()), "bubble (s)": t.bubble_s,
                         "vs the fastest": t.total_s / self.plan.time.total_s - 1 if self.plan and plan.fits else None})
        return sorted(rows, key=lambda r: (not r["fits"], r["s per step"]))

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "plan": self.plan.as_dict() if self.plan else None, "case": self.case,
                "guide": GUIDE[self.case][0], "agrees_with_guide": self.agrees, "reasons": self.reasons,
                "global_batch": self.global_batch, "machine": describe(self.machine),
                "plans": [p.as_dict() for p in self.plans],
                "too_big": [{"label": p.label, "per_gpu_bytes": p.memory.per_rank_bytes["total"]}
                            for p in self.too_big]}


def default_global_batch(seq_len: int, gpus: int) -> int:
    """About half a million tokens per step (GPT-3's batch for its smallest models, Brown et al.
    2020, Table 2.1), in whole samples, a multiple of the GPUs."""
    samples = math.ceil(2**19 / seq_len)
    return math.ceil(samples / gpus) * gpus


def advise(base: Setup, gpus: int | None = None, memory_bytes: int | None = None, nodes: int = 1,
           interconnect: str = "fast", machine: Machine | str | None = None,
           global_batch: int | None = None, overlap: bool = True, gpu: str | None = None) -> Advice:
    """Recommend how to train `base.model` (its dtype, optimizer, lengths, checkpointing) on
    `machine` (a `machines.MACHINES` name or a Machine), or on `gpus` GPUs of `memory_bytes`
    in `nodes` nodes whose links between nodes are `interconnect` ("fast" or "slow"), with
    `global_batch` samples per step (default `default_global_batch`). `memory_bytes` with a
    machine: use that much of each GPU. overlap=False: time the steps as if no collective hid
    behind compute (`step_time.step_time`). `gpu` (a key of `machines.GPU_SHEETS`): the GPUs of a machine
    given by counts compute at that GPU's datasheet peaks, not an H100's. A `base` asked on_cuda (as
    `python -m multigpu advise` asks: its machines are GPUs) is estimated with the GPU's kernels, and, where it
    gives none, with cuBLAS's workspaces of the machine's GPU."""
    from multigpu.estimator.question import check_setup

    check_setup(replace(base, strategy="single", world_size=1, tp=1, pp=1, cp=1, ep=None, sequence_parallel=False,
                        offload_optimizer=False))  # the lengths, the dtype, the optimizer: before any use
    if gpus is not None and not isinstance(gpus, bool) and gpus > MAX_GPUS:
        raise ConfigError(f"--gpus must be at most {MAX_GPUS:,} (the largest clusters built hold a few hundred "
                          f"thousand), got {gpus:,}")
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or not 1 <= global_batch <= MAX_GLOBAL_BATCH):
        raise ConfigError(f"--global-batch must be a whole number of samples from 1 to {MAX_GLOBAL_BATCH:,}, got "
                          f"{global_batch!r}; leave it out for about half a million tokens per step")
    machine = _machine(machine, gpus, memory_bytes, nodes, interconnect, gpu)
    if base.on_cuda and not base.cuda_workspace_bytes:
        base = replace(base, cuda_workspace_bytes=cublas_workspace_bytes(gpu or machine.gpu.name))
    memory = memory_bytes or machine.gpu.memory_bytes
    if memory <= 0:
        raise ConfigError(f"the memory of one GPU of {machine.name} is not known: give it (e.g. 16GiB)")
    if global_batch is None:
        global_batch = default_global_batch(base.seq_len, machine.gpus)
    found = plans(base, machine, memory, global_batch, overlap)
    if not found:
        raise ConfigError(f"a global batch of {global_batch} does not split over the data-parallel ranks of any "
                          f"plan on {machine.gpus} GPUs; use a multiple of {machine.gpus}")
    fitting = sorted((p for p in found if p.fits), key=_speed)
    too_big = sorted((p for p in found if not p.fits), key=lambda p: p.memory.per_rank_bytes["total"])
    case, why = _case(base, machine, memory)
    name = Path(base.model).stem  # a config file by its name, not its path
    named = GUIDE[case][1]
    reasons = [f"The case: {why}. The guide says: \"{GUIDE[case][0]}\" ({GUIDE_SOURCE})."]
    if not fitting:
        smallest = too_big[0] if too_big else None
        reasons.append(f"No plan fits {name} into {memory / 2**30:.0f} GiB per GPU with {global_batch} samples "
                       f"per step" + (f"; the smallest, {smallest.label}, needs "
                                      f"{smallest.memory.per_rank_bytes['total'] / 2**30:.1f} GiB" if smallest else "")
                       + ". Checkpoint activations, use more GPUs, or GPUs with more memory.")
        return Advice("does not fit", None, case, reasons, None, [], too_big, machine, global_batch)
    best = fitting[0]
    reasons.append(f"Fastest estimated plan for {global_batch} samples of {base.seq_len} tokens per step: "
                   f"{best.summary()}.")
    if best.family == "ZeRO+CP":
        one = estimate(replace(base, strategy="single", world_size=1, tp=1, pp=1, cp=1, grad_accum_steps=1), 1)
        reasons.append(f"The guide predates context parallelism. Here the sequence is what does not fit: one sample of "
                       f"{base.seq_len} tokens keeps {one.per_rank_bytes['activations'] / 2**30:.1f} GiB of "
                       f"activations on one GPU, which no sharding of the model states cuts; {best.label} gives each "
                       f"of {best.degrees['cp']} ranks its part of every sequence (chapter \"Context parallelism\").")
    agrees = best.family in GUIDE_NAMES[named[0]]
    reasons.append(f"The numbers {'agree with' if agrees else 'disagree with'} the guide's first choice, "
                   f"{named[0]}" + ("." if agrees else f": the fastest plan is {best.family}."))
    for name in named:  # the guide's choices for the case, each by its fastest plan
        other = next((p for p in fitting if p.family in GUIDE_NAMES[name]), None)
        if other is None:
            closest = next((p for p in too_big if p.family in GUIDE_NAMES[name]), None)
            reasons.append(f"{name}: nothing fits" + (f" (the closest, {closest.label}, needs "
                                                      f"{closest.memory.per_rank_bytes['total'] / 2**30:.1f} GiB)"
                                                      if closest else " (no such plan for this model)") + ".")
        elif other is not best:
            reasons.append(f"{name}: {other.summary()}, {other.time.total_s / best.time.total_s - 1:.0%} slower.")
    return Advice(best.setup.strategy, best, case, reasons, agrees, fitting, too_big, machine, global_batch)


def _speed(plan: Plan) -> tuple:
    """Fastest first; among equally fast plans the one that changes and sends least."""
    return plan.time.total_s, SIMPLEST_FIRST.index(plan.family), plan.setup.grad_accum_steps


def _machine(machine, gpus, memory_bytes, nodes, interconnect, gpu=None) -> Machine:
    if isinstance(machine, str):
        if machine not in MACHINES:
            raise ConfigError(f"unknown machine {machine!r}; choose one of: {', '.join(MACHINES)}")
        machine = MACHINES[machine]
    if machine is not None:
        if gpus not in (None, machine.gpus):
            raise ConfigError(f"{machine.name} has {machine.gpus} GPUs, not {gpus}: give one or the other")
        return machine
    if gpus is None or memory_bytes is None:
        raise ConfigError("give a machine (e.g. 8xh100-nvlink), or the GPUs and the memory of one GPU")
    if interconnect not in ("fast", "slow"):
        raise ConfigError(f"--interconnect must be fast or slow, got {interconnect!r}")
    return generic_machine(gpus, nodes, memory_bytes, interconnect == "fast", gpu)


def _case(base: Setup, machine: Machine, memory: int) -> tuple[str, str]:
    """The guide's case for this model on this machine, and the numbers that decide it."""
    name, gib = Path(base.model).stem, memory / 2**30
    one = estimate(replace(base, strategy="single", world_size=1, tp=1, pp=1, grad_accum_steps=1), 1)
    states = estimate(replace(base, strategy="single", world_size=1, tp=1, pp=1, grad_accum_steps=1))
    fits = one.per_rank_bytes["total"] <= memory
    need = (f"one sample needs {one.per_rank_bytes['total'] / 2**30:.1f} GiB on one GPU, of which the model states "
            f"are {states.per_rank_bytes['total'] / 2**30:.1f} GiB")
    if machine.nodes > 1 and (machine.fast_between_nodes or not fits):
        # the guide's slow-link entry is for a model "still low on GPU memory": one that does not fit on one GPU
        speed = "fast" if machine.fast_between_nodes else "slow"
        return f"several nodes, {speed} links", (f"{machine.nodes} nodes joined by {machine.inter.name} ({speed}); "
                                                  f"{name} {'fits' if fits else 'does not fit'} on one {gib:.0f} GiB "
                                                  f"GPU ({need})")
    if fits and machine.nodes > 1:
        return "fits on one GPU", (f"{name} fits on one {gib:.0f} GiB GPU ({need}), so it is not \"still low on GPU "
                                   f"memory\", the guide's condition for its slow-link entry ({machine.nodes} nodes "
                                   f"joined by {machine.inter.name})")
    if fits:
        return "fits on one GPU", f"{name} fits on one {gib:.0f} GiB GPU ({need})"
    block = model_shape(base.model).largest_block
    block_states = estimate(replace(base, model=f"params:{block}", strategy="single", world_size=1, tp=1, pp=1,
                                    grad_accum_steps=1)).per_rank_bytes["total"]
    if block and block_states > memory:
        return "largest layer does not fit on one GPU", (
            f"{name} does not fit on one {gib:.0f} GiB GPU ({need}), and neither do the model states of its largest "
            f"block, {block_states / 2**30:.1f} GiB: a block is the smallest piece a pipeline stage holds (and "
            "FSDP's unit here)")
    return "does not fit on one GPU", f"{name} does not fit on one {gib:.0f} GiB GPU ({need})"


def plans(base: Setup, machine: Machine, memory: int, global_batch: int, overlap: bool = True) -> list[Plan]:
    """For every grid the package can run `base.model` on with this machine's GPUs, the
    fastest split of `global_batch` into micro-batches that fits (or, if none fits, the one
    that needs the least memory)."""
    found = []
    for setup in grids(base, machine):
        dp = setup.grid.dp
        if global_batch % dp:
            continue  # the batch does not split over the data-parallel ranks
        tried = []
        for m in _divisors(global_batch // dp):
            candidate = replace(setup, grad_accum_steps=m)
            if _microbatch_problem(candidate):
                continue
            tried.append(Plan(candidate, global_batch, estimate(candidate, global_batch),
                              step_time(candidate, global_batch, machine, overlap), memory))
            if tried[-1].fits and setup.strategy not in PIPELINES:
                break  # without a bubble to shrink, more micro-batches only add collectives
        if tried:
            fitting = [p for p in tried if p.fits]
            found.append(min(fitting, key=_speed) if fitting else
                         min(tried, key=lambda p: p.memory.per_rank_bytes["total"]))
    return found


def grids(base: Setup, machine: Machine) -> list[Setup]:
    """Every strategy and grid to compare on `machine`: tensor parallelism only within a node
    and only at degrees that split the heads, the MLP and the vocabulary; pipelines only at
    degrees that divide the blocks."""
    from multigpu.models import family, tensor_parallel_problems

    n, per_node = machine.gpus, machine.gpus_per_node
    plain = replace(base, world_size=n, tp=1, pp=1, cp=1, ep=None, grad_accum_steps=1)
    if n == 1:
        return [replace(plain, strategy="single")]
    experts = model_shape(base.model).experts
    if experts:  # a mixture of experts trains with ep-scratch or fsdp (ep 1: no experts cut); the all-to-all in a node
        return [replace(plain, strategy=s, ep=e) for s in ("ep-scratch", "fsdp") for e in _divisors(min(n, per_node))
                if n % e == 0 and experts % e == 0]
    out = [replace(plain, strategy=s) for s in ADVISED]
    if base.model.startswith("params:") or family(base.model) != "gpt":
        return out  # tensor and pipeline parallelism cut the package's GPT only
    parts = gpt_parts(base.model)
    tps = [t for t in _divisors(per_node) if t > 1 and n % t == 0
           and not tensor_parallel_problems(base.model, t, base.seq_len, False)]
    for t in tps:
        out.append(replace(plain, strategy="tp", tp=t) if t == n else replace(plain, strategy="fsdp", tp=t))
    from multigpu.strategies.cp_attention import sequence_problem

    for c in (c for c in _divisors(per_node) if c > 1 and n % c == 0):  # the ring talks in every layer: in a node
        if not sequence_problem(base.seq_len, c, "zigzag"):
            out.append(replace(plain, strategy="fsdp", cp=c))
    for p in (p for p in _divisors(n) if p > 1 and parts.layers % p == 0):
        for t in [1, *tps]:
            if n % (p * t):
                continue
            for schedule in ("pp-1f1b", "pp-interleaved"):
                if parts.layers % (2 * p) and schedule == "pp-interleaved":
                    continue  # two stages per rank
                out.append(replace(plain, strategy=schedule, pp=p, tp=t))
    return out


def _microbatch_problem(setup: Setup) -> str | None:
    if setup.strategy not in PIPELINES:
        return None
    from multigpu.strategies.pp import microbatch_problem

    return microbatch_problem(setup.strategy, setup.grad_accum_steps, setup.grid.pp)


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending, by trial division up to its square root (a billion answers at once)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]
