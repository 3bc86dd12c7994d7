"""The closed forms the chapters reason with: a pipeline's bubble, what each strategy hands to
its collectives per step, what crosses a PCIe link under ZeRO-Offload.

Each function is a formula from a paper, written once here so that the chapters' exercises,
the estimator and the step model ask it instead of typing it again. They take numbers
(parameter counts, widths in bytes, ranks), never a model's name: shapes come from
`multigpu.estimator.model_shape` and `gpt_parts`, times from a link's `seconds`. Payloads are
what one rank hands to a collective, as `multigpu.comm.CommCounter` counts them; what the ring
then makes it send is `multigpu.comm.sent_bytes`. `tests/test_formulas.py` holds each formula
to a committed record, to torch's own schedules and FLOP counts, or to the package's counters.

Only leaf modules are imported here (`comm`, `memory`), so that the estimator and the step
model can import this module without a cycle.
"""

from __future__ import annotations

import math

from multigpu.comm import sent_bytes
from multigpu.memory import zero_model_states

# -- pipeline parallelism -------------------------------------------------------------------


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """The share of a step each rank idles: (p-1)/(vm+p-1).

    p ranks, m micro-batches per step, v stages per rank (interleaved 1F1B; 1 for GPipe and
    1F1B). Each rank computes m(t_f+t_b) of a step lasting (m + (p-1)/v)(t_f+t_b): the fill
    and the drain are p-1 actions, each 1/v of a rank's share of the model. GPipe's count
    (Huang et al. 2019, section 2.2), with interleaving as Narayanan et al. 2021 (section 2.2)
    shortens it. Exact for 1F1B and GPipe at any m >= 1, for interleaved 1F1B at m a
    multiple of p; not for the zero-bubble schedules (Qi et al. 2024), which fill part of it."""
    return (p - 1) / (v * m + p - 1)


def v_schedule_bubble(p: int, m: int) -> float:
    """The share of a step each rank idles under the V schedules (zero-bubble ZB-V, Qi et al. 2024; DualPipeV,
    DeepSeek-AI 2024, torch's ScheduleDualPipeV), when a stage's forward, input gradient and weight gradient
    each take one unit t (the zero-bubble paper's t_F = t_B = t_W) and nothing overlaps: (p-1)/(6m+p-1).

    p ranks of two stages each (rank r holds r and 2p-1-r), m >= 2p micro-batches: a rank computes 6m units
    and the step lasts 6m + p - 1, the fill of one forward unit per rank before the last. The count of torch's
    own schedules run on a clock (tests/test_formulas.py), not the papers' tables: DualPipe's
    (PP/2-1)(F&B+B-3W) assumes a forward and a backward overlapped into one F&B, which these stages do not."""
    return (p - 1) / (6 * m + p - 1)


def bubble_over_ideal(p: int, m: int, v: int = 1) -> float:
    """The same idle time over the ideal step, not the actual one: (p-1)/(vm).

    Megatron-LM's ratio (Narayanan et al. 2021, section 2.2), which the Ultra-Scale Playbook
    uses too; above 1 when m < p-1. The step model adds compute x this as the bubble's time."""
    return (p - 1) / (v * m)


def pipeline_action_cost(runs: list[tuple[int, int, float, float]]) -> float:
    """The seconds each forward-and-backward pair on a GPipe or 1F1B step's critical path costs beyond its compute,
    fitted by least squares (through zero) to `runs` of (p, m, compute of one pair, measured step): the step
    is (m + p - 1)(pair + cost), the bubble's formula with every action paying a message and bookkeeping."""
    pairs = [(m + p - 1, step - (m + p - 1) * pair) for p, m, pair, step in runs]
    return sum(x * y for x, y in pairs) / sum(x * x for x, _ in pairs)


def bubble_with_action_cost(p: int, m: int, pair_s: float, cost_s: float) -> float:
    """The share of a step each rank idles when every action pair costs `cost_s` beyond its `pair_s` of compute:
    1 - m pair / ((m + p - 1)(pair + cost)); bubble_fraction(p, m) at no cost."""
    return 1 - m * pair_s / ((m + p - 1) * (pair_s + cost_s))


def micro_batches_for_bubble(p: int, target: float, v: int = 1) -> int:
    """The fewest micro-batches m whose bubble_fraction(p, m, v) is below `target` (0 < target < 1).

    From (p-1)/(vm+p-1) < target: m > (p-1)(1/target - 1)/v; the closed form is checked
    against the fraction itself, so a rounding at the boundary cannot make it one off."""
    if not 0 < target < 1:
        raise ValueError(f"the bubble wanted must lie between 0 and 1, got {target!r}")
    m = max(1, math.floor((p - 1) * (1 / target - 1) / v) + 1)
    while m > 1 and bubble_fraction(p, m - 1, v) < target:
        m -= 1
    while bubble_fraction(p, m, v) >= target:
        m += 1
    return m


def pipeline_step_seconds(p: int, m: int, forward_s: float, backward_s: float, v: int = 1) -> float:
    """A pipeline step with no message cost: (m + (p-1)/v)(t_f + t_b).

    forward_s, backward_s: one micro-batch's forward and backward through one rank's share of
    the model (all v of its stages). GPipe's and 1F1B's step (Huang et al. 2019, section 2.2;
    Narayanan et al. 2021, section 2.2); what a rank computes of it is m(t_f+t_b)."""
    return (m + (p - 1) / v) * (forward_s + backward_s)


def micro_batches_in_flight(schedule: str, p: int, m: int, rank: int = 0, v: int = 2) -> float:
    """The most micro-batches whose activations rank `rank` of a p-rank pipeline holds at once.

    GPipe: m, every forward runs before the first backward (Huang et al. 2019).
    1F1B: min(p - rank, m), a warm-up of p - rank - 1 forwards and then one forward per
    backward (PipeDream-Flush, Narayanan et al. 2021, section 2.2).
    Interleaved 1F1B with v stages per rank: Megatron-LM's warm-up of (v-1)p + 2(p-rank-1)
    stage forwards plus the one in the steady state, each 1/v of a micro-batch, at most all
    v m of them (Narayanan et al. 2021, section 2.2; for m a multiple of p). For v = 2 that is
    (p - rank) + (p-1)/2. `schedule`: the strategy's name, from scratch or the library's."""
    kind = schedule.removeprefix("pp-").removesuffix("-scratch")
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - rank, m)
    if kind == "interleaved":
        return min((v - 1) * p + 2 * (p - rank) - 1, v * m) / v
    raise ValueError(f"no in-flight formula for schedule {schedule!r}: gpipe, 1f1b or interleaved")


def cross_rank_boundaries(p: int, v: int = 1, placement: str = "loop") -> int:
    """How many of the vp - 1 boundaries between consecutive stages lie between two ranks.

    Every such boundary carries each micro-batch's activations forward and their gradients
    back, so a step's point-to-point bytes grow with this count. "loop" (rank r holds stages
    r, r+p, ...; interleaved 1F1B, Narayanan et al. 2021): all vp - 1. "v" (rank r holds r and
    2p-1-r, the zero-bubble V schedules, Qi et al. 2024): the v - 1 turns of the V stay inside
    one rank, so vp - v. One rank: none."""
    if p == 1:
        return 0
    if placement == "loop":
        return v * p - 1
    if placement == "v":
        return v * p - v
    raise ValueError(f"placement must be 'loop' or 'v', got {placement!r}")


# -- all-reduce, built three ways -----------------------------------------------------------


def all_reduce_sent_by_rank(algorithm: str, payload_bytes: float, ranks: int) -> list[float]:
    """Bytes each rank sends to all-reduce `payload_bytes` on `ranks` ranks, rank 0 first.

    "naive": every rank sends its whole tensor to the N-1 others, (N-1) x the data each.
    "parameter server" (Li et al. 2014): rank 0 is the server; each worker sends its tensor
    once, the server sends the sum back to the N-1 workers: (N-1) x the data on one link.
    "ring" (Patarasuk and Yuan 2009): a reduce-scatter then an all-gather, 2(N-1)/N x the
    data from every rank (`comm.sent_bytes`). `multigpu.collectives` builds all three."""
    if algorithm == "naive":
        return [(ranks - 1) * payload_bytes] * ranks
    if algorithm == "parameter server":
        return [(ranks - 1) * payload_bytes] + [payload_bytes] * (ranks - 1)
    if algorithm == "ring":
        return [sent_bytes("all_reduce", payload_bytes, ranks)] * ranks
    raise ValueError(f"algorithm must be 'naive', 'parameter server' or 'ring', got {algorithm!r}")


# -- data parallelism: DDP, ZeRO, FSDP, HSDP ------------------------------------------------


def sent_per_rank(payloads: dict[str, float], ranks: int) -> float:
    """Bytes one rank sends for these payloads (kind -> bytes) on `ranks` ranks, all kinds
    together: each kind's ring cost, `comm.sent_bytes` (Thakur et al. 2005)."""
    return sum(sent_bytes(kind, nbytes, ranks) for kind, nbytes in payloads.items())


def zero_payloads(stage: int, parameters: int, ranks: int, grad_width: int = 4, weight_width: int = 4,
                  gathered_once: int = 0) -> dict[str, float]:
    """What one rank hands to each collective per step under ZeRO stage 0 (DDP) to 3, in bytes.

    grad_width, weight_width: bytes of a gradient and of a gathered parameter (4 in fp32, 2 in
    bf16). Rajbhandari et al. 2020, section 7: stage 0 all-reduces the gradients (2Psi sent,
    by the ring); stages 1 and 2 reduce-scatter them and all-gather the updated shards after
    the step (2Psi, as DDP); stage 3 gathers the parameters before forward and again before
    backward (3Psi). `gathered_once`: parameters gathered only once, because they stay
    gathered from forward to backward (the root unit of FSDP1 and of the package's ZeRO-3;
    all of them under FSDP's reshard_after_forward=False)."""
    grads = grad_width * parameters
    if stage == 0:
        return {"all_reduce": grads}
    if stage in (1, 2):
        return {"reduce_scatter": grads, "all_gather": weight_width * parameters / ranks}
    if stage == 3:
        return {"reduce_scatter": grads, "all_gather": weight_width * (2 * parameters - gathered_once) / ranks}
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")


def fsdp_calls(units: int, gathered_once: int = 0) -> dict[str, int]:
    """Collective calls per step of FSDP with `units` wrapped units (a unit per block and the root).

    Each unit is all-gathered before its forward and again before its backward, and its
    gradients reduce-scattered once (Zhao et al. 2023, "FSDP units"); `gathered_once` units stay
    gathered from forward to backward and are gathered once (FSDP1's root; all units under
    reshard_after_forward=False). The number of ranks changes only the size of each shard."""
    return {"all_gather": 2 * units - gathered_once, "reduce_scatter": units}


def fsdp_gathered_bytes(parameters: int, outside_blocks: int, largest_block: int, width: int = 4,
                        one_unit: bool = False) -> int:
    """The most gathered parameters a rank holds at once beyond its own shard, in bytes.

    One unit: the whole model while the unit computes. A unit per block: the root unit
    (embeddings, final norm, head), gathered through the step, beside the largest block that
    computes (a unit is the largest piece of the model ever whole on a rank: Zhao et al.
    2023, "FSDP units"). width: bytes of a gathered parameter."""
    return width * (parameters if one_unit else outside_blocks + largest_block)


def hsdp_payloads(parameters: int, shard_ranks: int, replicas: int, grad_width: int = 4,
                  weight_width: int = 4) -> dict[str, float]:
    """Per-step payloads of one rank under hybrid sharding (HSDP), in bytes.

    Inside each shard group of `shard_ranks` ranks, FSDP's two all-gathers and one
    reduce-scatter (`zero_payloads` stage 3); across the `replicas` groups, an all-reduce of
    this rank's shard of the summed gradient with the ranks that hold the same shard
    (Zhao et al. 2023, "Hybrid Sharding"). One replica: plain FSDP."""
    payloads = zero_payloads(3, parameters, shard_ranks, grad_width, weight_width)
    if replicas > 1:
        payloads["all_reduce"] = grad_width * parameters / shard_ranks
    return payloads


def hsdp_seconds(parameters: int, shard_ranks: int, replicas: int, shard_link, shard_share: float = 1.0,
                 replica_link=None, replica_share: float = 1.0, grad_width: int = 4,
                 weight_width: int = 4) -> tuple[float, float]:
    """(seconds inside the shard groups, seconds across the replicas) of a step's HSDP
    collectives, nothing hidden behind compute.

    Each link comes with the share of its bandwidth one group gets, as
    `multigpu.estimator.step_time.group_link` returns them; a link is anything with
    `seconds(kind, payload_bytes, ranks, share)` (`machines.Link`: Hockney's alpha-beta model,
    one call per kind). One replica over all N ranks: plain FSDP, whose ring crosses every link
    between its ranks. The payloads are `hsdp_payloads`'."""
    payloads = hsdp_payloads(parameters, shard_ranks, replicas, grad_width, weight_width)
    inside = sum(shard_link.seconds(kind, payloads[kind], shard_ranks, shard_share)
                 for kind in ("all_gather", "reduce_scatter"))
    across = (replica_link.seconds("all_reduce", payloads["all_reduce"], replicas, replica_share)
              if replicas > 1 else 0.0)
    return inside, across


def offload_pcie_bytes(parameters: int, ranks: int, width: int = 2) -> float:
    """Bytes that cross each GPU's PCIe link per step, each way, under ZeRO-Offload with stage 2.

    The rank's gradient shard goes down to the host, which runs the optimizer there, and the
    updated parameter shard comes back: width x Psi / N each way, 2Psi/N in the paper's fp16
    (Ren et al. 2021, section 4, the offload strategy: 4Psi in all for one GPU, fp16 gradients
    down and fp16 parameters up; ZeRO-2 partitions both over the N GPUs)."""
    return width * parameters / ranks


def offload_host_bytes(parameters: int, ranks: int, gpus_per_node: int, optimizer: str = "adamw",
                       dtype: str = "bf16-master") -> float:
    """Host memory a node needs for the optimizer states its GPUs offload under ZeRO-Offload
    with stage 2: each GPU's shard of the optimizer state (fp32 master weights and Adam's
    moments in mixed precision, `memory.zero_model_states`), times the node's GPUs
    (Ren et al. 2021, section 4)."""
    return zero_model_states(parameters, ranks, 2, optimizer, dtype)["optimizer"] * gpus_per_node


# -- tensor parallelism ---------------------------------------------------------------------

LOSS_VALUES_PER_TOKEN = 3  # the vocabulary-parallel cross-entropy's all-reduces: max, sum of exp, target logit


def tp_region_crossings(layers: int, phase: str = "step") -> int:
    """Collectives on the (batch, seq, width) hidden states: 2L+1 in forward, 2L+1 in backward.

    Forward: two per block (attention's and the MLP's row-parallel outputs) and the
    vocabulary-parallel embedding's; backward: two per block and the head's input gradient
    (Shoeybi et al. 2019, section 3: the f and g operators). One all-reduce each, or, with
    sequence parallelism, a reduce-scatter and an all-gather each (Korthikanti et al. 2022,
    section 4.2.2). phase: "forward", "backward" or the whole "step", 2(2L+1)."""
    if phase not in ("forward", "backward", "step"):
        raise ValueError(f"phase must be 'forward', 'backward' or 'step', got {phase!r}")
    return (2 * layers + 1) * (2 if phase == "step" else 1)


def tp_step_calls(layers: int, sequence_parallel: bool = False, phase: str = "step") -> dict[str, int]:
    """Collective calls of tensor parallelism on a GPT of `layers` blocks, per step or per phase
    (`tp_region_crossings`), with the vocabulary-parallel loss's three all-reduces in forward."""
    crossings = tp_region_crossings(layers, phase)
    calls = {"reduce_scatter": crossings, "all_gather": crossings} if sequence_parallel else {"all_reduce": crossings}
    if phase != "backward":
        calls["all_reduce"] = calls.get("all_reduce", 0) + LOSS_VALUES_PER_TOKEN
    return calls


def tp_step_payloads(layers: int, tokens: int, d_model: int, ranks: int, value_bytes: int = 4,
                     sequence_parallel: bool = False, phase: str = "step") -> dict[str, float]:
    """What one rank hands to each collective of tensor parallelism, per step or per phase, in bytes.

    tokens: batch x sequence of the step (all of it: every rank sees every sample); value_bytes:
    bytes of an activation (4 fp32, 2 bf16). Each crossing (`tp_region_crossings`) carries one
    tokens x d_model tensor; with sequence parallelism the reduce-scatter takes it whole and
    the all-gather this rank's 1/t of the sequence. The loss adds three fp32 numbers per
    token in forward (Shoeybi et al. 2019, section 3). The gradients of what every rank keeps
    whole (LayerNorms, row-parallel biases) are summed after the step, outside these counts."""
    crossings = tp_region_crossings(layers, phase) * tokens * d_model * value_bytes
    payloads = ({"reduce_scatter": crossings, "all_gather": crossings / ranks} if sequence_parallel
                else {"all_reduce": crossings})
    if phase != "backward":
        payloads["all_reduce"] = payloads.get("all_reduce", 0) + LOSS_VALUES_PER_TOKEN * tokens * 4
    return payloads


def tp_comm_over_compute(t: int, h: int, flops_per_s: float, bandwidth_bytes_per_s: float,
                         value_bytes: int) -> float:
    """A block's tensor-parallel collectives over its compute, in time: e(t-1)F / (9hB).

    Per token a block computes 72h^2 FLOPs forward and backward (24h^2 forward: 4h^2 in
    attention's projections, 8h^2 in the MLP, two FLOPs a multiply-add; backward twice that),
    1/t of it on each rank; its four all-reduces of h values of e bytes make a rank send
    4 x 2(t-1)/t x h e bytes. On a device of F FLOP/s and a link of B bytes/s the ratio is
    (8he(t-1)/t / B) / (72h^2/t / F). The chapter's derivation, from Shoeybi et al. 2019,
    section 3."""
    return value_bytes * (t - 1) * flops_per_s / (9 * h * bandwidth_bytes_per_s)


def tp_even_width(t: int, flops_per_s: float, bandwidth_bytes_per_s: float, value_bytes: int) -> float:
    """The width h at which `tp_comm_over_compute` is 1: h = e(t-1)F / (9B)."""
    return value_bytes * (t - 1) * flops_per_s / (9 * bandwidth_bytes_per_s)


MLP_FLOPS_PER_TOKEN = 48  # x width^2: h -> 4h -> h, 16 h^2 forward, twice that backward


def tp_mlp_even_width(tokens: int, ranks: int, flops_per_s: float, alpha_s: float, beta_s_per_byte: float,
                      value_bytes: int = 4) -> float:
    """The MLP width w at which `ranks` tensor-parallel ranks take as long as one.

    One rank computes 48 w^2 FLOPs per token (h -> 4h -> h, forward and backward); t ranks
    each 1/t of it, plus an all-reduce of tokens x w values forward and one backward, each
    alpha + beta x sent. They break even where what the split saves pays for the two:
        48 w^2 tokens (1 - 1/t) / F = 2 (alpha + beta sent(e tokens w)),
    a quadratic in w whose positive root this returns (sent: the ring's bytes, linear in w)."""
    a = MLP_FLOPS_PER_TOKEN * tokens * (1 - 1 / ranks) / flops_per_s
    b = -2 * beta_s_per_byte * sent_bytes("all_reduce", value_bytes * tokens, ranks)
    c = -2 * alpha_s
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


# -- mixtures of experts ---------------------------------------------------------------------

def moe_expert_parameters(d_model: int, expert_ffn: int, experts: int, moe_layers: int, gated: bool = True,
                          biases: bool = False) -> int:
    """Parameters of the routed experts of a mixture of experts: per layer E MLPs d -> f -> d, three
    matrices each where the MLP is gated (SwiGLU: Mixtral, DeepSeek), two otherwise (GELU: this
    package's), with their biases where it has them."""
    per_expert = (3 if gated else 2) * d_model * expert_ffn + ((expert_ffn + d_model) if biases else 0)
    return moe_layers * experts * per_expert


def moe_active_parameters(total: int, expert_parameters: int, experts: int, top_k: int) -> int:
    """Parameters one token computes with: everything but the routed experts, and k of every E."""
    return total - expert_parameters + expert_parameters * top_k // experts


def ep_states_per_rank(total: int, expert_parameters: int, ep: int, bytes_per_parameter: float = 16) -> float:
    """Model states a rank keeps under expert parallelism alone: the dense part whole, 1/ep of the
    experts; 16 bytes a parameter by default (mixed-precision Adam: ZeRO paper, Rajbhandari et al.
    2020, section 3.1)."""
    return (total - expert_parameters + expert_parameters / ep) * bytes_per_parameter


def ep_all_to_all_bytes_per_token(top_k: int, d_model: int, value_bytes: int) -> int:
    """Bytes per token and MoE layer that forward hands to the two all-to-alls (dispatch, then
    combine): each of its k choices' d_model values out and back, 2 k h e. Backward the same again.
    Of it, (ep - 1)/ep leaves the rank on average: a choice lands on the rank's own experts 1/ep of
    the time."""
    return 2 * top_k * d_model * value_bytes


def dropped_share_uniform(capacity_factor: float, tokens: int, top_k: int, experts: int) -> float:
    """The expected share of (token, choice) assignments dropped when each of `tokens` tokens of a
    group (a sequence here) picks its k experts uniformly at random and each expert takes
    C = ceil(factor x tokens x k / E) of them: an expert's load is then Binomial(tokens, k/E) (a
    token picks k different experts), of which max(0, load - C) are dropped. An even load would drop
    max(0, 1 - C E / (tokens k)) of them; a skewed router drops more."""
    from multigpu.moe import capacity

    n, p = tokens, top_k / experts
    limit = capacity(capacity_factor, tokens, top_k, experts)
    if p >= 1:  # every token to every expert
        return experts * max(0, n - limit) / (tokens * top_k)

    def pmf(x: int) -> float:  # in logarithms: the binomial coefficients of long sequences overflow a float
        return math.exp(math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
                        + x * math.log(p) + (n - x) * math.log1p(-p))

    over = sum(pmf(x) * (x - limit) for x in range(limit + 1, n + 1))
    return experts * over / (tokens * top_k)


def checkpoint_state_bytes(parameters: int, states_per_parameter: int, value_bytes: int = 4) -> int:
    """A checkpoint's tensors: every weight and the optimizer's `states_per_parameter` values for each
    (AdamW 2, SGD with momentum 1, SGD 0), at `value_bytes` each (fp32: 4). The step counts, the generators
    and the index add a little; a tensor saved under two names (a tied weight) counts twice."""
    return parameters * (1 + states_per_parameter) * value_bytes


def young_interval_s(save_s: float, mean_time_between_failures_s: float) -> float:
    """Young's first-order optimum interval between checkpoints, sqrt(2 x save time x mean time between
    failures) (Young 1974): shorter wastes time saving, longer loses more work per failure."""
    return math.sqrt(2 * save_s * mean_time_between_failures_s)
