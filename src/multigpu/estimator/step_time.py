"""What one training step costs on a machine (`multigpu.estimator.machines`): a model of it,
not a measurement.

`step_time` puts one training step together:
- compute: the FLOPs `estimator.flops` counts from the model's modules: 6 per weight per token
  (forward 2, backward 4), plus the attention's 12 L h s per token (the Ultra-Scale Playbook's
  count, as picotron's MFU uses it), and activation checkpointing's second forward of each
  block; at the machine's achieved FLOP/s;
- the collectives of each dimension of the rank grid on the link the placement puts them on,
  the part that cannot hide behind compute added to the step (the strategy table's
  `overlap`);
- the pipeline's bubble: (p-1)/m of the compute for GPipe and 1F1B, (p-1)/(v m) interleaved
  (Narayanan et al. 2021), which is (p-1)/(m+p-1) of the step.

`recorded_machine` is the machine that made the records, as the model sees it: its links
fitted to its timed collectives, its compute rate what one of its processes achieved.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from multigpu.errors import ConfigError
from multigpu.estimator.flops import SampleFlops, sample_flops
from multigpu.estimator.machines import GPU, Link, Machine
from multigpu.estimator.model_trace import gpt_parts, model_shape
from multigpu.estimator.question import PIPELINES, Setup, data_parallel_kind
from multigpu.estimator.share import bf16_weights, gradient_buckets, rank_shares, sharded_elements, zero2_reduces
from multigpu.recompute import recompute_mode
from multigpu.strategy_table import STRATEGY_TABLE


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step, by where they go. `comm_s`: what each grid dimension's
    collectives take ("dp", "tp", "pp"); `exposed_s`: what of it adds to the step."""

    compute_s: float
    bubble_s: float
    comm_s: dict = field(default_factory=dict)
    exposed_s: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + sum(self.exposed_s.values())

    def as_dict(self) -> dict:
        return {"total_s": self.total_s, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "comm_s": dict(self.comm_s), "exposed_comm_s": dict(self.exposed_s)}


def flops_per_sample(setup: Setup) -> float:
    """FLOPs of forward and backward for one sample as the machine runs them: the model's products counted
    from its modules (`estimator.flops`: 6 per weight per token, attention's 12 L h s), activation checkpointing's
    second forward included."""
    return _sample_flops(setup).hardware(setup.activation_checkpointing)


def _sample_flops(setup: Setup) -> SampleFlops:
    return sample_flops(setup.model, setup.seq_len, setup.target_len)


def attention_share(setup: Setup) -> float:
    """The share of a step's FLOPs that attention's scores and weighted sums take: what a context-parallel ring's
    transfers can hide behind."""
    flops = _sample_flops(setup)
    full = recompute_mode(setup.activation_checkpointing) == "full"  # selective keeps attention's output
    return flops.attention * (4 if full else 3) / flops_per_sample(setup)


def backward_share(setup: Setup) -> float:
    """The share of a step's FLOPs that run in backward (a checkpointed block's second forward among them): what
    data parallelism's gradient collectives can hide behind."""
    flops = _sample_flops(setup)
    return (flops_per_sample(setup) - flops.forward) / flops_per_sample(setup)


def group_link(machine: Machine, size: int, stride: int) -> tuple[Link, float]:
    """The link a collective of `size` ranks `stride` apart runs on, and the share of its
    bandwidth each of the groups running at once gets. Ranks fill nodes in order, tp
    innermost, then dp, then pp (`runtime.RankGrid`'s layout): a group inside one node uses
    the GPUs' own links; across nodes a ring leaves each node once, and every group of its
    kind runs the same collective at the same time, so gpus_per_node / (members per node)
    rings share each node's network."""
    per_node = machine.gpus_per_node
    if size == 1 or (size - 1) * stride < per_node:
        return machine.intra, 1.0
    if machine.inter is None:
        raise ConfigError(f"a group of {size} ranks {stride} apart spans nodes, but {machine.name} has no link "
                          "between nodes")
    members_per_node = max(1, per_node // stride)
    share = min(1.0, members_per_node / per_node,
                machine.intra.bandwidth_bytes_per_s / machine.inter.bandwidth_bytes_per_s)
    return machine.inter, share


@dataclass(frozen=True)
class Traffic:
    """Calls of one collective a rank makes in one step, as the step-time model counts them: their kind, their
    payload in all (the bytes handed in, as `comm.CommCounter` counts them: an all-gather's shards, a
    reduce-scatter's whole input), the group, and what the calls may hide behind."""

    dim: str  # the grid dimension it serves: "dp", "tp", "cp", "moe" or "pp"
    kind: str
    payload_bytes: float
    group_size: int  # the group's ranks (a send goes to one of them: priced as a group of two)
    stride: int  # the group's ranks are this many apart (where the placement puts the link)
    calls: int
    hides: str = "none"  # what it may run behind: "backward", "all" (the compute), "attention" or "none"


# What may run while the GPU computes, and behind which compute (the rest adds to the step), as
# the strategy table's `overlap` column says it:
# DDP's bucketed all-reduce and ZeRO-2's bucketed reduce-scatter behind backward; ZeRO-3's and
# FSDP's prefetched all-gathers and their reduce-scatters behind forward and backward. Nothing
# else hides: ZeRO-1's reduce-scatter waits for the end of backward, ZeRO-1/2's all-gather of the
# updated parameters for the optimizer step, FSDP inside a pipeline stage gathers once before the
# step's first forward and reduce-scatters after its last backward, and tensor parallelism's
# all-reduces and a pipeline's sends are each awaited by the next layer or stage. Hiding is taken
# as perfect up to the compute it runs behind: real overlap is partial (the collectives' kernels
# compete with the compute's), so the sharded strategies' times are lower bounds; `step_time`'s
# overlap=False gives the other bound, where nothing hides.
def collectives(setup: Setup, global_batch: int, pipeline_rank: int | None = None) -> list[Traffic]:
    """Every collective one rank makes in a step of `global_batch` samples, by dimension; under a pipeline, the
    rank `pipeline_rank` (default: a middle one, which sends both ways). Held against dry runs of the strategies'
    own code (`multigpu.estimator.held`): the calls and bytes are theirs, the differences named there."""
    grid, kind = setup.grid, setup.strategy
    dp, tp, pp, cp, m = grid.dp, grid.tp, grid.pp, grid.cp, setup.grad_accum_steps
    n = setup.replicas  # the ranks that hold the same piece of the model: dp, and cp (each holds it whole)
    out = []
    shares = rank_shares(setup)
    params = max(s.parameters for s in shares)  # the busiest rank's, cut by tp, before data-parallel sharding
    grad_width = 2 if setup.dtype == "bf16-master" else 4
    weight_width = 2 if bf16_weights(setup) else 4  # what ZeRO-3 gathers (FSDP's mixed precision: bf16 copies)
    act_width = 2 if setup.dtype != "fp32" else 4  # activations between layers and stages
    if n > 1:  # the data-parallel collectives, once per step or per micro-batch, over dp x cp ranks
        run = data_parallel_kind(setup)
        if run in ("fsdp", "zero3") and (padded := sharded_elements(setup, shares[0])):
            params = padded * n  # what the shards hold, padding included, is what is gathered and scattered
        grads, weights, units = params * grad_width, params * weight_width, max(s.blocks for s in shares) + 1
        buckets = gradient_buckets(setup, grad_width)  # DDP's gradients go in buckets
        behind = STRATEGY_TABLE[run].overlap if run in STRATEGY_TABLE else "none"  # pp-fsdp: none
        dp_traffic = lambda kind, payload, calls, size=n, stride=tp, hides=behind: Traffic(  # noqa: E731
            "dp", kind, payload, size, stride, calls, hides)
        if run == "ddp" and grid.ep > 1:  # ep-scratch: the dense part over dp, a rank's experts over their copies
            routed = model_shape(setup.model).expert_parameters // grid.ep * grad_width
            out += [dp_traffic("all_reduce", grads - routed, buckets),
                    dp_traffic("all_reduce", routed, buckets, n // grid.ep, grid.ep)]
        elif run == "ddp":
            out.append(dp_traffic("all_reduce", grads, buckets))
        elif run == "zero1":  # one flat buffer: one reduce-scatter after backward, one all-gather after the step
            out += [dp_traffic("reduce_scatter", grads, 1), dp_traffic("all_gather", grads / n, 1)]
        elif run == "zero2":  # each full bucket's pieces reduced to the ranks that own them (strategies/zero.py):
            # a reduce-scatter's bytes, in a call per owner a bucket reaches; it keeps only its gradient shard
            # between micro-batches
            reduces = zero2_reduces(setup, grad_width) or buckets
            out += [dp_traffic("reduce", m * grads, m * reduces),
                    # the updated parameters' all-gather follows the optimizer step: it does not hide
                    dp_traffic("all_gather", grads / n, 1, hides="none")]
        elif run in ("zero3", "fsdp"):
            gathers = 1 if (run == "fsdp" and not setup.reshard_after_forward) else 2  # per micro-batch, per unit
            if run == "zero3":  # ours keeps the root unit (the embeddings, the head) gathered through the step,
                # and its gradient whole until the step's last backward: once per step
                share, blocks = shares[0], units - 1
                outside = math.ceil(share.outside_blocks / n) * n if blocks else params  # its flat buffer, padded
                out += [dp_traffic("all_gather", (m * 2 * (params - outside) + outside) * weight_width / n,
                                   m * 2 * blocks + 1),
                        dp_traffic("reduce_scatter", (m * (params - outside) + outside) * grad_width, m * blocks + 1)]
            else:  # FSDP2 gathers every unit again for each micro-batch, but sums the gradients of all but the
                # last unsharded (no_sync: set_requires_gradient_sync(False)) and reduce-scatters once per step
                out += [dp_traffic("all_gather", m * gathers * weights / n, m * gathers * units),
                        dp_traffic("reduce_scatter", grads, units)]
        else:  # FSDP inside a pipeline stage: once per step
            out += [dp_traffic("all_gather", weights / n, 1), dp_traffic("reduce_scatter", grads, 1)]
    # one micro-batch's hidden states (b, s, h): what tensor parallelism all-reduces and a stage sends (a context-
    # parallel rank's: its part of the sequence)
    activation = global_batch // (dp * m) * setup.rank_seq_len * act_width * (
        gpt_parts(setup.model).d_model if tp > 1 or pp > 1 else 0)
    if tp > 1:  # per micro-batch: each block's two all-reduces forward and two backward (three and three
        # when checkpointing recomputes the forward), the embedding's forward and the head's backward; pipelines
        # and the from-scratch tensor parallelism included
        per_block, blocks = 6 if setup.activation_checkpointing else 4, max(s.blocks for s in shares)
        if setup.sequence_parallel:  # each all-reduce becomes a reduce-scatter into the rank's slice of the
            # sequence and an all-gather of the slices (the same bytes), and three more pairs: the token and the
            # position embeddings' outputs, the head's input; the LayerNorms, whole on every rank, sum their
            # gradients' partial sums (the weight and the bias of two per block and the last)
            calls = m * (per_block * blocks + 3)
            norms = (2 * blocks + 1) * 2
            out += [Traffic("tp", "reduce_scatter", calls * activation, tp, 1, calls),
                    Traffic("tp", "all_gather", calls * activation / tp, tp, 1, calls),
                    Traffic("tp", "all_reduce", m * norms * gpt_parts(setup.model).d_model * grad_width, tp, 1,
                            m * norms)]
        else:
            calls = m * (per_block * blocks + 2)
            out.append(Traffic("tp", "all_reduce", calls * activation, tp, 1, calls))
        # the cross-entropy of vocabulary-sharded logits (loss_parallel, the default; tp-scratch's own): the
        # maximum, the sum of exponentials and the target's logit of every token, in fp32
        tokens = global_batch // (dp * m) * setup.rank_seq_len
        out.append(Traffic("tp", "all_reduce", m * 3 * tokens * 4, tp, 1, m * 3))
    if cp > 1:  # ring attention, per micro-batch and layer: keys and values round the ring forward, again
        # backward with their gradients (cp_attention.sent_bytes_per_layer); each transfer overlaps the
        # attention the rank computes meanwhile, so at most the attention's share of the compute hides it
        from multigpu.strategies.cp_attention import sent_bytes_per_layer

        parts = gpt_parts(setup.model)
        per_layer = sent_bytes_per_layer("ring", cp, global_batch // (dp * m), parts.heads // tp, setup.seq_len,
                                         parts.d_model // parts.heads, act_width)
        out.append(Traffic("cp", "send", m * parts.layers * (per_layer["forward"] + per_layer["backward"]), cp, tp,
                           m * parts.layers * (3 * cp - 2), "attention"))
        out.append(Traffic("cp", "all_reduce", m * 4, cp, tp, m))  # each micro-batch's loss, summed for the record
    shape = model_shape(setup.model)
    if shape.experts and dp > 1:  # a mixture of experts, per micro-batch and MoE layer (again in checkpointing's
        # recompute): its E + 1 counts summed over dp for the balancing loss; with ep, the counts to the ep ranks,
        # then each token's k rows to their experts and back (dispatch, combine), and backward's two; the
        # next layer waits for them: nothing hides
        passes = m * shape.blocks * (2 if setup.activation_checkpointing else 1)  # (selective too: in-place c10d)
        out.append(Traffic("moe", "all_reduce", passes * (shape.experts + 1) * 8, dp, 1, passes))
        if grid.ep > 1:
            tokens = global_batch // (dp * m) * setup.seq_len
            rows = tokens * shape.top_k * gpt_parts(setup.model).d_model * act_width  # one all-to-all's, a rank's
            out.append(Traffic("moe", "all_to_all",
                               passes * (shape.experts * 8 + 2 * rows) + m * shape.blocks * 2 * rows,
                               grid.ep, 1, passes * 3 + m * shape.blocks * 2))
    if kind in PIPELINES:  # each micro-batch's activations to the next stage, their gradients to the one before
        from multigpu.strategies.pp import SCHEDULES

        r = pp // 2 if pipeline_rank is None else pipeline_rank
        v = SCHEDULES[kind].stages_per_rank  # a rank's stages: r, r + pp, ... (the first sends no gradient back,
        sends = m * (2 * v - (r == 0) - (r == pp - 1))  # the last no activation on)
        out.append(Traffic("pp", "send", sends * activation, pp, dp * tp, sends))
        if r in (0, pp - 1) and shape.family == "gpt" and gpt_parts(setup.model).tied:  # the embedding's
            # gradient, summed between the first stage (the embedding) and the last (the head that shares it)
            out.append(Traffic("pp", "all_reduce", gpt_parts(setup.model).embedding * grad_width / tp, 2,
                               dp * tp * (pp - 1), 1))
        out.append(Traffic("pp", "broadcast", 8, pp, dp * tp, 1))  # the step's loss, from the last stage to all
    return out


def step_time(setup: Setup, global_batch: int, machine: Machine, overlap: bool = True) -> StepTime:
    """The model of one step of `global_batch` samples: see the module's docstring. Its communication is
    `collectives`, priced on the link each group's placement puts it on.
    overlap=False: no collective hides behind compute (the step's upper bound; by default
    hiding is perfect, the lower)."""
    if setup.strategy == "dp":
        raise ConfigError("the step-time model covers one process per GPU; DataParallel (dp) runs one process")
    if setup.world_size != machine.gpus:
        raise ConfigError(f"{setup.strategy} on {setup.world_size} ranks, but {machine.name} has {machine.gpus} GPUs")
    compute = flops_per_sample(setup) * global_batch / (setup.world_size * machine.flops_per_s(setup.dtype))
    behind = {"backward": compute * backward_share(setup), "all": compute,
              "attention": compute * attention_share(setup)}
    comm, hidden, exposed = defaultdict(float), defaultdict(float), defaultdict(float)
    from multigpu.strategies.pp import SCHEDULES

    m, pp = setup.grad_accum_steps, setup.grid.pp
    for t in collectives(setup, global_batch):
        link, share = group_link(machine, t.group_size, t.stride)
        seconds = link.seconds(t.kind, t.payload_bytes, 2 if t.kind == "send" else t.group_size, share, calls=t.calls)
        if t.dim == "pp" and t.kind == "send" and t.calls:  # the step waits on its critical path's transfers,
            # not on one rank's: 2 v (m + p - 1) of them (v stages per rank), each one micro-batch's activation
            path = 2 * SCHEDULES[setup.strategy].stages_per_rank * (m + pp - 1)
            seconds = link.seconds("send", path * t.payload_bytes / t.calls, 2, share, calls=path)
        comm[t.dim] += seconds
        if overlap and t.hides != "none":
            hidden[t.dim] = behind[t.hides]  # one budget of compute per dimension
        else:
            exposed[t.dim] += seconds
    exposed = {dim: exposed[dim] + max(0.0, comm[dim] - exposed[dim] - hidden[dim]) for dim in comm}
    bubble = 0.0
    if setup.strategy in PIPELINES:
        from multigpu.estimator.formulas import bubble_over_ideal

        bubble = compute * bubble_over_ideal(setup.grid.pp, setup.grad_accum_steps,
                                             SCHEDULES[setup.strategy].stages_per_rank)  # (p-1)/(vm) of the ideal
    return StepTime(compute, bubble, dict(comm), exposed)


def recorded_machine(ranks: int = 2, tag: str | None = None) -> Machine:
    """The machine that made the records (`tag`: a folder of results/; default the richest
    with both experiments),
    as `ranks` CPU processes: its link is the alpha-beta fit of its timed collectives
    (experiment link_model), and its compute rate what one process achieved training
    gpt-small alone (experiment tp_scaling: one thread, as each rank has)."""
    from multigpu import records

    if tag is None:  # the richest machine that has both: a fit and a step from the same machine
        tag = next((t for t in records.machines_with("tp_scaling") if t in records.machines_with("link_model")), None)
    fits = tuple((r["collective"], r["alpha_s"], r["beta_s_per_byte"]) for r in records.load("link_model", tag)
                 if r["world_size"] == ranks)
    if not fits:
        raise ConfigError(f"no recorded link model for {ranks} ranks: the link_model experiment times 2 and 4")
    single = next(r for r in records.load("tp_scaling", tag) if r["config"]["strategy"] == "single")
    c, prov = single["config"], single["provenance"]
    setup = Setup(c["model"], "single", 1, seq_len=c["seq_len"], dtype=c["dtype"])
    rate = flops_per_sample(setup) * c["global_batch_size"] / single["step_time_s"]
    core = GPU(f"one CPU process of {prov['device_names'][0]}, {prov['threads_per_worker']} thread", 0, rate, rate,
               f"measured: {c['model']}'s single-process step in tp_scaling ({prov['machine_tag']}, "
               f"{prov['date'][:10]})")
    median = sorted(a for _, a, _ in fits)[len(fits) // 2]
    link = Link(f"{prov['backend']} over loopback, fitted", 1 / max(b for _, _, b in fits), median,
                f"measured: link_model's timed collectives on {ranks} ranks ({prov['machine_tag']})",
                "measured: the fitted alpha of each collective", fits)
    return Machine(f"{prov['machine_tag']} as {ranks} processes", core, ranks, 1, link, None, mfu=1.0,
                   mfu_source="measured: the rate is what a process achieved, not a share of a peak")
