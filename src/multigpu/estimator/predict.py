"""`python -m multigpu predict`: the time of one given plan on a named machine, from kernels and
collective curves (an estimate, not a measurement).

A plan is a model, its degrees (tp, pp, dp, and cp beside data parallelism), how data parallelism
runs (`dp_kind`: ddp, zero1 as Megatron's distributed optimizer, fsdp), the batch (micro-batch,
global batch, sequence), the precision, recomputation, the attention kernel, and a machine. Its step:
- compute: one rank's kernels (`kernels.step_kernels` of the whole model at the micro-batch,
  each product, attention and memory-bound kernel cut by tp and the layers by pp, the optimizer's
  by its shard), walked with the host's launches (`kernels.timeline`) for every micro-batch, then
  the optimizer's step, on the GPU's rates (`rates.gpu_compute`);
- communication: the collectives the estimator counts for the layout (`step_time.collectives`;
  data parallelism beside tensor parallelism as the data-parallel kind's own collectives over the
  rank's tp-cut weights), each priced on the link its group sits on (`step_time.group_link`) by
  a published nccl-tests curve (`links`); what hides behind compute as the strategy table says;
- the pipeline's bubble, (p-1)/m of the compute (1F1B);
- context parallelism (cp, beside data parallelism only, as the package runs it: FSDP, or whole
  replicas for ddp): each rank computes its 1/cp of every sequence (the zig-zag layout balances
  the causal work), its attention against every key in cp fused calls, and the ring's keys and
  values hide behind those calls.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, replace

from multigpu.errors import ConfigError
from multigpu.estimator import links
from multigpu.estimator.kernels import Kernel, check_attention, depth, shallower, step_kernels, timeline
from multigpu.estimator.machines import GPU_SHEETS, Machine

DP_KINDS = ("ddp", "zero1", "fsdp")
NAMED = {  # name: (GPU, GPUs per node, link inside a node, link between nodes)
    "dgx-a100": ("a100-80gb", 8, links.NVLINK3_MEASURED, links.HDR_MEASURED),
    "dgx-h100": ("h100-80gb", 8, links.NVLINK4_MEASURED, links.NDR_MEASURED),
}
MAX_GPUS = 2**20
# the largest value each whole-number key takes
LIMITS = {"tp": MAX_GPUS, "pp": MAX_GPUS, "dp": MAX_GPUS, "cp": MAX_GPUS, "virtual_stages": 1024, "micro_batch": 2**20,
          "seq_len": 2**20, "global_batch": 2**40, "gpus_per_node": 1024, "nodes": MAX_GPUS}
PLAN_KEYS = ("model", "tp", "pp", "dp", "cp", "virtual_stages", "dp_kind", "micro_batch", "global_batch", "seq_len",
             "dtype", "activation_checkpointing", "machine", "gpu", "gpus_per_node", "nodes", "inter", "optimizer",
             "attention", "dropout")


@dataclass(frozen=True)
class Plan:
    model: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: each sequence cut over cp ranks (beside data parallelism)
    virtual_stages: int = 1  # a pipeline's stages per rank (interleaved 1F1B from 2)
    dp_kind: str = "ddp"
    micro_batch: int = 1
    global_batch: int | None = None  # default: micro_batch x dp
    seq_len: int = 1024
    dtype: str = "bf16-mixed"
    activation_checkpointing: bool | str = False
    machine: str | None = None
    gpu: str | None = None
    gpus_per_node: int = 8
    nodes: int | None = None
    inter: float | None = None  # Gb/s per GPU between nodes
    optimizer: str = "adamw"
    attention: str = "fused"  # one kernel (FlashAttention, SDPA), or "unfused" (Megatron-LM's before it)
    dropout: float = 0.0  # the attention probabilities' (a kernel of its own when unfused)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def _machine(plan: Plan) -> tuple[Machine, str]:
    """The plan's machine and its GPU's key."""
    if plan.machine is not None:
        if plan.machine not in NAMED:
            raise ConfigError(f"unknown machine {plan.machine!r}; give --machine one of: {', '.join(NAMED)}, or "
                              "--gpu NAME --gpus-per-node N --nodes M --inter GBITS")
        gpu, per_node, intra, inter = NAMED[plan.machine]
    elif plan.gpu is not None:
        if plan.gpu not in GPU_SHEETS:
            raise ConfigError(f"unknown GPU {plan.gpu!r}; give --gpu one of: {', '.join(GPU_SHEETS)}")
        gpu, per_node = plan.gpu, plan.gpus_per_node
        intra = links.NVLINK3_MEASURED if gpu.startswith("a100") else links.NVLINK4_MEASURED
        rate = 400.0 if plan.inter is None else plan.inter
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1e6:
            raise ConfigError(f"--inter {rate}: give the network's Gb/s per GPU, a positive number (e.g. 400)")
        inter = replace(links.NDR_MEASURED, name=f"{rate:g} Gb/s per GPU, priced by EFA v4's curve scaled",
                        bandwidth_bytes_per_s=links.NDR_MEASURED.bandwidth_bytes_per_s * rate / 400,
                        curve=tuple((s, r * rate / 400) for s, r in links.NDR_MEASURED.curve))
    else:
        raise ConfigError("give a machine: --machine dgx-a100 or dgx-h100, or --gpu NAME (with --gpus-per-node, "
                          "--nodes, --inter)")
    if per_node < 1:
        raise ConfigError(f"--gpus-per-node {per_node}: give a positive count")
    nodes = plan.nodes or max(1, math.ceil(plan.world / per_node))
    if nodes * per_node != plan.world and not (nodes == 1 and plan.world < per_node):
        raise ConfigError(f"tp x pp x dp = {plan.world} GPUs, but {nodes} node(s) of {per_node} hold "
                          f"{nodes * per_node}: change --nodes or the degrees")
    per_node = min(per_node, plan.world)
    return Machine(f"{nodes} x {per_node} {GPU_SHEETS[gpu].name}", GPU_SHEETS[gpu], per_node, nodes, intra,
                   inter if nodes > 1 else None), gpu


def _rank_kernels(plan: Plan) -> tuple[list[Kernel], list[Kernel]]:
    """One rank's kernels of a micro-batch and of the optimizer's step: the whole model's, cut. Tensor
    parallelism cuts each kernel's work and each product's shape by tp; a pipeline stage runs 1/pp of the
    layers: each kernel's work and its launches by pp (a shape is its layer's, whole)."""
    every = step_kernels(plan.model, plan.micro_batch, plan.seq_len // plan.cp, plan.dtype,
                         plan.activation_checkpointing, plan.optimizer, plan.attention, plan.dropout)
    if plan.cp > 1:  # a rank's queries against every key: cp fused calls of its block's size
        every = tuple(replace(k, flops=k.flops * plan.cp, launches=k.launches * plan.cp) if k.kind == "attention"
                      else k for k in every)
    shard = plan.dp * plan.cp if plan.dp_kind != "ddp" else 1  # the optimizer's state and step cut over the copies

    def scaled(k: Kernel, shape_cut: int, count_cut: float) -> Kernel:
        parts = shape_cut * count_cut
        return replace(k, flops=k.flops / parts, bytes=k.bytes / parts, launches=k.launches / count_cut,
                       size=(k.size**3 / shape_cut) ** (1 / 3))

    passes = [scaled(k, plan.tp, plan.pp) for k in every if k.phase != "optimizer"]
    tail = [scaled(k, plan.tp * shard, plan.pp) for k in every if k.phase == "optimizer"]
    return passes, tail


def _setups(plan: Plan):
    """The estimator's `Setup`s whose collectives are the plan's: (one for tp/pp, one for data parallelism or
    None, the payload's cut of the second)."""
    from multigpu.estimator.question import Setup

    m = plan.global_batch // (plan.micro_batch * plan.dp)
    if plan.cp > 1:  # FSDP over dp x cp ranks, or whole replicas (cp-scratch) for ddp
        kind = "fsdp" if plan.dp_kind == "fsdp" else "cp-scratch"
        return Setup(strategy=kind, world_size=plan.dp * plan.cp, cp=plan.cp, model=plan.model, seq_len=plan.seq_len,
                     dtype=plan.dtype, optimizer=plan.optimizer, activation_checkpointing=plan.activation_checkpointing,
                     grad_accum_steps=m, on_cuda=True, dropout=False), None, 1
    common = dict(model=plan.model, seq_len=plan.seq_len, dtype=plan.dtype, optimizer=plan.optimizer,
                  activation_checkpointing=plan.activation_checkpointing, grad_accum_steps=m, on_cuda=True,
                  dropout=False)
    if plan.pp > 1:
        kind = "pp-interleaved" if plan.virtual_stages > 1 else "pp-1f1b"
        return Setup(strategy=kind, world_size=plan.world, tp=plan.tp, pp=plan.pp, **common), None, 1
    kind = {"ddp": "ddp", "zero1": "zero1", "fsdp": "fsdp"}[plan.dp_kind]
    if plan.tp == 1:
        return Setup(strategy=kind if plan.dp > 1 else "single", world_size=plan.dp, **common), None, 1
    model_parallel = Setup(strategy="tp", world_size=plan.tp, tp=plan.tp, **{**common, "grad_accum_steps": m})
    data = Setup(strategy=kind, world_size=plan.dp, **common) if plan.dp > 1 else None
    return model_parallel, data, plan.tp


def predict(plan: Plan) -> dict:
    """The plan's step, estimated: seconds, tokens/s per GPU, MFU, and where the time goes."""
    from multigpu.estimator.flops import sample_flops
    from multigpu.estimator.formulas import bubble_over_ideal
    from multigpu.estimator.question import MAX_SEQ_LEN
    from multigpu.estimator.rates import gpu_compute
    from multigpu.estimator.step_time import backward_share, collectives, group_link

    for name, most in LIMITS.items():
        value = getattr(plan, name)
        if value is None and name in ("global_batch", "nodes"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ConfigError(f"{name} must be a whole number from 1 to {most:,}, got {value!r}")
    if plan.seq_len > MAX_SEQ_LEN:
        raise ConfigError(f"seq_len {plan.seq_len:,} is beyond any model here; give at most {MAX_SEQ_LEN:,}")
    if plan.world > MAX_GPUS:
        raise ConfigError(f"tp x pp x dp = {plan.world:,} GPUs; give at most {MAX_GPUS:,}")
    check_attention(plan.attention, plan.dropout)
    if plan.cp > 1:
        from multigpu.strategies.cp_layout import sequence_problem

        if plan.tp > 1 or plan.pp > 1:
            raise ConfigError("predict prices context parallelism beside data parallelism only, as the package runs "
                              "it (FSDP x CP, or whole replicas): give --tp 1 --pp 1 with --cp")
        if plan.attention != "fused":
            raise ConfigError("context parallelism runs fused attention on each block of keys: give --attention fused")
        if plan.dp_kind == "zero1":
            raise ConfigError("context parallelism runs beside FSDP or whole replicas: give --dp-kind fsdp or ddp")
        if why := sequence_problem(plan.seq_len, plan.cp, "zigzag"):
            raise ConfigError(why)
    if plan.dp_kind not in DP_KINDS:
        raise ConfigError(f"dp_kind must be one of {', '.join(DP_KINDS)}, got {plan.dp_kind!r}")
    global_batch = plan.global_batch or plan.micro_batch * plan.dp
    if global_batch % (plan.micro_batch * plan.dp):
        raise ConfigError(f"the global batch {global_batch} is not a whole number of micro-batches of "
                          f"{plan.micro_batch} on each of {plan.dp} data-parallel ranks")
    plan = replace(plan, global_batch=global_batch)
    machine, gpu = _machine(plan)
    compute = gpu_compute(gpu)
    m = global_batch // (plan.micro_batch * plan.dp)
    compute_s, busy = _compute(plan, compute, m)
    first, data, cut = _setups(plan)
    traffic = [t for t in collectives(first, plan.micro_batch * m * (first.grid.dp if data is None else 1))
               if data is None or t.dim != "dp"]
    if data is not None:
        traffic += [replace(t, payload_bytes=t.payload_bytes / cut, stride=plan.tp)
                    for t in collectives(data, plan.micro_batch * m * plan.dp) if t.dim == "dp"]
    behind = {"backward": compute_s * backward_share(first), "all": compute_s,
              "attention": busy.get("attention", 0.0), "none": 0.0}  # the ring's transfers: behind attention
    comm, exposed = defaultdict(float), defaultdict(float)
    hidden: dict = {}
    for t in traffic:
        link, share = group_link(machine, t.group_size, t.stride)
        if not isinstance(link, links.CurveLink):
            raise ConfigError(f"{machine.name}: no measured curve for its link {link.name}")
        calls = t.calls
        if t.dim == "pp" and t.kind == "send" and t.calls:  # the critical path's transfers, 2 v (m + p - 1), each
            # tensor-parallel rank sending its 1/tp of the activation (Megatron's scatter/gather, Narayanan et al.
            # 2021, section 4.1)
            calls = 2 * plan.virtual_stages * (m + plan.pp - 1)
            seconds = link.seconds("send", calls * t.payload_bytes / t.calls / plan.tp, 2, share, calls)
        else:
            seconds = link.seconds(t.kind, t.payload_bytes, 2 if t.kind == "send" else t.group_size, share, calls)
        comm[t.dim] += seconds
        if t.hides != "none":
            hidden[t.dim] = behind[t.hides]
        else:
            exposed[t.dim] += seconds
    exposed = {d: exposed[d] + max(0.0, comm[d] - exposed[d] - hidden.get(d, 0.0)) for d in comm}
    bubble = compute_s * bubble_over_ideal(plan.pp, m, plan.virtual_stages) if plan.pp > 1 else 0.0
    total = compute_s + bubble + sum(exposed.values())
    model_flops = sample_flops(plan.model, plan.seq_len).model * global_batch
    peak = machine.gpu.fp32_flops if plan.dtype == "fp32" else machine.gpu.bf16_flops
    return {"step_time_s": total, "tokens_per_s_per_gpu": global_batch * plan.seq_len / total / plan.world,
            "mfu": model_flops / (total * plan.world * peak), "compute_s": compute_s,
            "gpu_busy_s": dict(busy), "bubble_s": bubble, "comm_s": dict(comm), "exposed_comm_s": exposed,
            "micro_batches": m, "machine": machine.name, "estimate": True,
            "compute_notes": list(compute.notes), "links": [machine.intra.source] + (
                [machine.inter.source] if machine.inter is not None else [])}


def _walk(plan: Plan, compute, m: int) -> tuple[float, dict]:
    """(seconds, the GPU's busy time by kind) of one rank's compute in a step: m micro-batches, the optimizer."""
    from multigpu.estimator.kernels import kernel_seconds

    passes, tail = _rank_kernels(plan)
    clocks = (0.0, 0.0)
    walked = [clocks := timeline(passes, compute, clocks) for _ in range(min(m, 2))]
    if m > 2:  # every micro-batch after the first takes the second's time
        clocks = tuple(b + (m - 2) * (b - a) for a, b in zip(*walked))
    busy: dict = defaultdict(float)
    for k in passes:
        busy[k.kind] += m * kernel_seconds(k, compute)
    busy["optimizer"] = sum(kernel_seconds(k, compute) for k in tail)
    return max(timeline(tail, compute, clocks)), dict(busy)


def _compute(plan: Plan, compute, m: int) -> tuple[float, dict]:
    """`_walk`; a deep decoder given as a config.json walked at one block and at two, and the second block's
    cost added once for each further block (the blocks are the same)."""
    layers = depth(plan.model)
    if layers is None or layers <= 2:
        return _walk(plan, compute, m)
    (one, busy_one), (two, busy_two) = (_walk(replace(plan, model=shallower(plan.model, n)), compute, m)
                                        for n in (1, 2))
    return one + (layers - 1) * (two - one), {k: busy_one[k] + (layers - 1) * (busy_two[k] - busy_one[k])
                                              for k in busy_one}


def plan_from(d: dict) -> Plan:
    """A `Plan` from a JSON object of the flags' names with underscores; an unknown key is refused by name."""
    unknown = sorted(set(d) - set(PLAN_KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}; a plan takes: {', '.join(PLAN_KEYS)}")
    if "model" not in d:
        raise ConfigError("a plan needs its model: \"model\": \"gpt2\" (a preset or a config.json)")
    return Plan(**d)


def predict_lines(lines) -> list[str]:
    """One JSON line out per plan line in (blank lines skipped): the prediction, or {"error": ...}."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ConfigError(f"line {n} is not a JSON object of a plan's keys")
            out.append(json.dumps(predict(plan_from(d))))
        except json.JSONDecodeError as e:
            out.append(json.dumps({"error": f"line {n} is not JSON: {e.msg}"}))
        except (ConfigError, TypeError) as e:
            out.append(json.dumps({"error": str(e)}))
    return out


def cmd_predict(args) -> int:
    """`predict`: one plan from the flags, or `--plans FILE` (one JSON object a line; one JSON line out each)."""
    if args.plans:
        try:
            with open(args.plans) as f:
                lines = f.readlines()
        except OSError as e:
            raise ConfigError(f"--plans {args.plans}: cannot read it ({e.strerror}); give a file of one JSON plan "
                              "a line") from None
        print("\n".join(predict_lines(lines)))
        return 0
    if args.model is None:
        raise ConfigError("give --model (a preset or a config.json), or --plans FILE")
    keys = {k: getattr(args, k) for k in PLAN_KEYS if getattr(args, k, None) is not None}
    out = predict(plan_from(keys))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"estimate: {out['step_time_s']:.4f} s per step on {out['machine']}, "
          f"{out['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {out['mfu']:.1%}")
    busy = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out["gpu_busy_s"].items())
    print(f"  compute {out['compute_s'] * 1e3:.1f} ms over {out['micro_batches']} micro-batch(es) (GPU busy: {busy})")
    for dim, seconds in out["comm_s"].items():
        print(f"  {dim} communication {seconds * 1e3:.2f} ms, exposed {out['exposed_comm_s'][dim] * 1e3:.2f} ms")
    if out["bubble_s"]:
        print(f"  pipeline bubble {out['bubble_s'] * 1e3:.1f} ms")
    for note in out["compute_notes"] + out["links"]:
        print(f"  source: {note}")
    return 0


def add_predict_command(sub) -> None:
    """The `predict` subcommand on `sub` (the command line's subparsers)."""
    p = sub.add_parser("predict", help="the time of one training step of a plan on a GPU machine (an estimate)")
    p.add_argument("--model", default=None, help="a preset (gpt2, ...) or a config.json")
    for name in ("tp", "pp", "dp", "cp"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--virtual-stages", dest="virtual_stages", type=int, default=None,
                   help="a pipeline's stages per rank (interleaved 1F1B)")
    p.add_argument("--dp-kind", dest="dp_kind", choices=DP_KINDS, default=None,
                   help="data parallelism as DDP, Megatron's distributed optimizer (zero1) or FSDP")
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=None)
    p.add_argument("--global-batch", dest="global_batch", type=int, default=None)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=None)
    p.add_argument("--dtype", choices=("fp32", "bf16-mixed", "fp16-mixed", "bf16-master"), default=None)
    p.add_argument("--optimizer", choices=("adamw", "sgd", "sgd-momentum"), default=None)
    p.add_argument("--activation-checkpointing", dest="activation_checkpointing", nargs="?", const=True,
                   default=None, choices=(True, "full", "selective"), metavar="full|selective")
    p.add_argument("--attention", choices=("fused", "unfused"), default=None,
                   help="one fused kernel (FlashAttention, SDPA: the default) or Megatron-LM's unfused core attention")
    p.add_argument("--dropout", type=float, default=None, help="the attention probabilities' dropout (unfused)")
    p.add_argument("--machine", default=None, help=f"a named machine: {', '.join(NAMED)}")
    p.add_argument("--gpu", default=None, help="or a GPU by name (a100-80gb, h100-80gb, h200-141gb, ...)")
    p.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=None)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--inter", type=float, default=None, help="the network between nodes, Gb/s per GPU (400)")
    p.add_argument("--plans", default=None, help="a file of plans, one JSON object a line; one JSON line out each")
    p.add_argument("--json", action="store_true", help="the prediction as JSON (step_time_s, ...)")
    p.set_defaults(func=cmd_predict)
