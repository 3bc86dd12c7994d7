"""The closed forms of multigpu.estimator.formulas, each against something that did not use it:
torch's own pipeline schedules and FLOP counter, and the committed records' counters (what
CommCounter and the memory tracker measured in real runs)."""

import contextlib
import io
import math

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    _Action,
    _ComputationType,
)
from torch.utils.flop_counter import FlopCounterMode

from multigpu import records
from multigpu.comm import sent_bytes
from multigpu.estimator import model_shape
from multigpu.estimator.formulas import (
    all_reduce_sent_by_rank,
    bubble_fraction,
    bubble_over_ideal,
    cross_rank_boundaries,
    fsdp_calls,
    fsdp_gathered_bytes,
    hsdp_payloads,
    hsdp_seconds,
    micro_batches_for_bubble,
    micro_batches_in_flight,
    offload_host_bytes,
    offload_pcie_bytes,
    pipeline_step_seconds,
    sent_per_rank,
    tp_comm_over_compute,
    tp_even_width,
    tp_mlp_even_width,
    tp_step_calls,
    tp_step_payloads,
    v_schedule_bubble,
    zero_payloads,
)
from multigpu.models import GPT_SIZES

F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
I, W = _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
COST = {F: 1, B: 2, I: 1, W: 1}  # a stage's forward 1 unit, its backward 2: the input's gradient 1, the weights' 1


def committed(experiment: str) -> list[dict]:
    """Every committed machine's records of `experiment` (the fixture hides any other folder)."""
    found = [r for tag in records.machines_with(experiment) for r in records.load(experiment, tag)]
    assert found, f"no committed records of {experiment}"
    return found


# -- pipelines: torch's schedules, run on a clock -------------------------------------------


def library_orders(schedule, p: int, m: int, v: int) -> list[list[_Action]]:
    """Each rank's compute actions in the order torch.distributed.pipelining runs them (an overlapped forward and
    backward, DualPipeV's, as its two actions one after the other)."""
    with contextlib.redirect_stdout(io.StringIO()):
        ops = get_schedule_ops(schedule, p, m, v if v > 1 else None)
    return [[sub for a in rank if a is not None for sub in (a.sub_actions or [a]) if sub.computation_type in COST]
            for rank in ops]


def scratch_orders(p: int, m: int) -> list[list[_Action]]:
    """The package's from-scratch 1F1B (torch's own 1F1B lists no valid order for its last rank)."""
    from multigpu.strategies.pp_scratch import one_f_one_b

    return [[_Action(s, F if a == "F" else B, i) for a, i in one_f_one_b(s, p, m)] for s in range(p)]


def run_on_a_clock(orders: list[list[_Action]], v: int) -> tuple[list[float], float]:
    """Run every rank's actions in its order, each as soon as its input exists: a stage's forward
    1 unit, its backward 2 (a stage is 1/v of a rank's share, so a micro-batch's whole forward on
    a rank is v units), split by the zero-bubble schedules into the input's gradient (1, which the
    stage before waits for) and the weights' (1, after its own input's). Returns (units each rank
    computed, the step's length)."""
    stages, done = v * len(orders), {}
    clock, busy, position = [0.0] * len(orders), [0.0] * len(orders), [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                a = order[position[r]]
                s, i, kind = a.stage_index, a.microbatch_index, a.computation_type
                forward = kind == F
                needs = ((s - 1, True, i) if s > 0 else None) if forward else (s, False, i) if kind == W else \
                    ((s, True, i) if s == stages - 1 else (s + 1, False, i))
                if needs is not None and needs not in done:
                    break
                clock[r] = max(clock[r], done.get(needs, 0.0)) + COST[kind]
                busy[r] += COST[kind]
                done[(s, forward, i) if kind != W else (s, "weights", i)] = clock[r]
                position[r] += 1
                moved = True
    assert all(position[r] == len(o) for r, o in enumerate(orders)), "the schedule deadlocked"
    return busy, max(clock)


CASES = ([("gpipe", ScheduleGPipe, 1, p, m) for p in (2, 3, 4) for m in (1, 2, 3, 5, 8)]
         + [("1f1b", None, 1, p, m) for p in (2, 3, 4) for m in (1, 2, 3, 5, 8)]
         + [("interleaved", ScheduleInterleaved1F1B, v, p, m)  # m a multiple of p, as the formula asks
            for v in (2, 3) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)])


@pytest.mark.parametrize("name, schedule, v, p, m", CASES)
def test_the_bubble_step_and_micro_batches_in_flight_are_those_of_the_schedules_run_on_a_clock(
        name, schedule, v, p, m):
    orders = scratch_orders(p, m) if schedule is None else library_orders(schedule, p, m, v)
    busy, step = run_on_a_clock(orders, v)
    for computed in busy:
        assert computed == 3 * v * m
        assert math.isclose(1 - computed / step, bubble_fraction(p, m, v))
        assert math.isclose((step - computed) / computed, bubble_over_ideal(p, m, v))
    assert math.isclose(step, pipeline_step_seconds(p, m, forward_s=v, backward_s=2 * v, v=v))
    for rank, order in enumerate(orders):
        alive = most = 0
        for a in order:  # a stage's forward keeps its activations until its backward
            alive += 1 if a.computation_type == F else -1
            most = max(most, alive)
        assert math.isclose(most / v, micro_batches_in_flight(f"pp-{name}", p, m, rank, v)), rank


@pytest.mark.parametrize("schedule", [ScheduleZBVZeroBubble, ScheduleDualPipeV])
@pytest.mark.parametrize("p, m", [(p, m) for p in (2, 3, 4) for m in (2 * p, 3 * p, 5 * p)])
def test_the_v_schedules_idle_their_formulas_share_when_run_on_a_clock(schedule, p, m):
    """ZB-V and DualPipeV as torch lists their actions, with every stage's forward, input gradient and weight
    gradient one unit each: every rank computes 6m units of a step of 6m + p - 1."""
    busy, step = run_on_a_clock(library_orders(schedule, p, m, 2), 2)
    assert all(computed == 6 * m for computed in busy)
    assert math.isclose(1 - busy[0] / step, v_schedule_bubble(p, m))


@pytest.mark.parametrize("p, v, target", [(4, 1, 0.10), (4, 2, 0.10), (8, 1, 0.05), (2, 1, 0.5), (3, 2, 0.2)])
def test_micro_batches_for_bubble_is_the_fewest_under_the_target(p, v, target):
    m = micro_batches_for_bubble(p, target, v)
    assert bubble_fraction(p, m, v) < target
    assert m == 1 or bubble_fraction(p, m - 1, v) >= target


@pytest.mark.usefixtures("committed_records")
def test_the_boundaries_between_ranks_carry_the_recorded_point_to_point_bytes():
    """Each boundary between ranks carries every sample's hidden states forward and their
    gradients back; the package's placements (strategies.pp) put the stages on the ranks."""
    from multigpu.strategies.pp import SCHEDULES, stage_rank

    for schedule in SCHEDULES.values():
        for p in (2, 3, 4):
            placed = sum(stage_rank(schedule, s, p) != stage_rank(schedule, s + 1, p)
                         for s in range(schedule.stages_per_rank * p - 1))
            assert placed == cross_rank_boundaries(p, schedule.stages_per_rank, schedule.placement)
    checked = 0
    for r in committed("pp_schedules") + committed("pp_memory"):
        c = r["config"]
        library = SCHEDULES.get(c["strategy"])
        v, placement = (library.stages_per_rank, library.placement) if library else (1, "loop")
        hidden = c["global_batch_size"] * c["seq_len"] * GPT_SIZES[c["model"]].d_model * 4  # fp32
        sent = sum(rank.get("send", 0) for rank in r["comm_payload_bytes_per_step_by_rank"])
        assert sent == 2 * cross_rank_boundaries(c["world_size"], v, placement) * hidden, c["strategy"]
        checked += 1
    assert checked


# -- all-reduce built three ways: what each implementation counted ---------------------------


@pytest.mark.usefixtures("committed_records")
def test_all_reduce_bytes_by_rank_are_what_the_implementations_counted():
    checked = set()
    for r in committed("collectives_bandwidth"):
        if r["algorithm"] not in ("naive", "parameter server", "ring"):
            continue
        predicted = all_reduce_sent_by_rank(r["algorithm"], r["size_bytes"], r["world_size"])
        if r["algorithm"] == "ring" and r["size_bytes"] % (4 * r["world_size"]):
            continue  # the ring's chunks are equal only when the ranks divide the values
        assert r["sent_bytes_by_rank"] == pytest.approx(predicted, rel=1e-12), (r["algorithm"], r["world_size"])
        checked.add(r["algorithm"])
    assert checked == {"naive", "parameter server", "ring"}


# -- data parallelism: what CommCounter and the memory tracker measured ---------------------

# strategy, extra -> (ZeRO stage, parameters gathered once, units gathered once)
SHARDED = {("ddp", ()): (0, None, None), ("zero1", ()): (1, None, None), ("zero2", ()): (2, None, None),
           ("zero3", ()): (3, "root", 1), ("fsdp", ()): (3, "none", 0), ("fsdp1", ()): (3, "root", 1),
           ("fsdp", (("reshard_after_forward", False),)): (3, "all", "all"),
           ("fsdp", (("wrap", "root"),)): (3, "none", 0)}


@pytest.mark.usefixtures("committed_records")
def test_zero_payloads_and_fsdp_calls_are_the_recorded_ones():
    checked = set()
    for r in committed("sharded_memory_comm"):
        c = r["config"]
        key = (c["strategy"], tuple(sorted(c["extra"].items())))
        if key not in SHARDED or c["dtype"] != "fp32":
            continue
        stage, once, units_once = SHARDED[key]
        shape, n = model_shape(c["model"]), c["world_size"]
        gathered_once = {None: 0, "none": 0, "root": shape.outside_blocks, "all": shape.parameters}[once]
        predicted = zero_payloads(stage, shape.parameters, n, gathered_once=gathered_once)
        payload, sent = r["comm_payload_bytes_per_step_by_rank"][0], r["comm_bytes_per_step_by_rank"][0]
        assert payload.get("all_gather", 0) == predicted.get("all_gather", 0), key
        assert sum(sent.values()) == pytest.approx(sent_per_rank(predicted, n)), key
        if units_once is not None:  # the units: one per block and the root, or the root alone
            units = 1 if c["extra"].get("wrap") == "root" else shape.blocks + 1
            calls = r["comm_calls_per_step_by_rank"][0]
            assert {k: calls[k] for k in ("all_gather", "reduce_scatter")} == \
                fsdp_calls(units, units if units_once == "all" else units_once), key
        checked.add(key)
    assert checked == set(SHARDED)


@pytest.mark.usefixtures("committed_records")
def test_fsdp_gathered_bytes_are_what_rank_0_held_beyond_its_shard():
    checked = 0
    for r in committed("sharded_memory_comm"):
        c = r["config"]
        if c["strategy"] != "fsdp" or c["extra"].get("reshard_after_forward") is False or c["dtype"] != "fp32":
            continue
        shape = model_shape(c["model"])
        held = r["peak_memory_bytes_by_rank"][0]["params"] - r["model_state_bytes_by_rank"][0]["params"]
        assert held == fsdp_gathered_bytes(shape.parameters, shape.outside_blocks, shape.largest_block, 4,
                                           one_unit=c["extra"].get("wrap") == "root")
        checked += 1
    assert checked


class CountingLink:
    """A link that writes down every call it is asked to time."""

    def __init__(self):
        self.calls = []

    def seconds(self, kind, payload_bytes, ranks, share=1.0):
        self.calls.append((kind, payload_bytes, ranks, share))
        return 1e-3 + sent_bytes(kind, payload_bytes, ranks) * share * 1e-9


@pytest.mark.usefixtures("committed_records")
def test_hsdp_payloads_and_seconds_are_the_recorded_collectives():
    hsdp = [r for r in committed("compositions") if r["config"]["extra"].get("replicas")]
    assert hsdp
    for r in hsdp:
        replicas, n = r["config"]["extra"]["replicas"], r["config"]["world_size"]
        shards, recorded = n // replicas, r["comm_payload_bytes_per_step_by_rank"][0]
        assert hsdp_payloads(r["parameters"], shards, replicas) == recorded
        inside, across = CountingLink(), CountingLink()
        seconds = hsdp_seconds(r["parameters"], shards, replicas, inside, 0.5, across, 0.25)
        assert sorted((k, b) for k, b, _, _ in inside.calls + across.calls) == sorted(recorded.items())
        assert {(ranks, share) for _, _, ranks, share in inside.calls} == {(shards, 0.5)}
        assert across.calls[0][2:] == (replicas, 0.25)
        assert seconds == (sum(inside.seconds(*c) for c in inside.calls[:2]),
                           across.seconds(*across.calls[0]))
    flat = CountingLink()  # one replica: plain FSDP, nothing across
    assert hsdp_seconds(1000, 8, 1, flat)[1] == 0.0
    assert sorted(k for k, *_ in flat.calls) == ["all_gather", "reduce_scatter"]


@pytest.mark.usefixtures("committed_records")
def test_offload_bytes_are_what_deepspeeds_offloaded_optimizer_keeps():
    """DeepSpeed's ZeRO-2 with offload_optimizer keeps, beside its optimizer state, the rank's
    gradient shard the GPU hands down each step (here fp32: the runs train in fp32)."""
    offloaded = [r for r in committed("offload") if r["config"]["extra"].get("zero_optimization")]
    assert offloaded
    for r in offloaded:
        n, states = r["config"]["world_size"], r["model_state_bytes_by_rank"][0]
        assert states["grads"] == offload_pcie_bytes(r["parameters"], n, width=4)
        assert states["optimizer"] == offload_host_bytes(r["parameters"], n, 1, "adamw", "fp32")
    assert offload_host_bytes(1000, 8, 8) == 12 * 1000  # the paper's 12 Psi of a node's 8 GPUs' shards


# -- tensor parallelism: the traced step's collectives, torch's FLOP counter ---------------


@pytest.mark.usefixtures("committed_records")
def test_tp_collectives_per_phase_and_step_are_the_traced_ones():
    checked = set()
    for r in committed("tp_collectives"):
        if r["strategy"] == "tp" and r["sequence_parallel"]:
            continue  # DTensor's loss_parallel adds one gather and one scatter of its own
        size, sp, tokens = GPT_SIZES[r["model"]], r["sequence_parallel"], r["batch"] * r["seq_len"]
        calls, payload = {}, {}
        for phase, seen in r["phases"].items():
            assert seen["calls"] == tp_step_calls(size.n_layer, sp, phase), phase
            assert seen["payload_bytes"] == tp_step_payloads(size.n_layer, tokens, size.d_model, r["tp"], 4, sp, phase)
            for k, v in seen["calls"].items():
                calls[k] = calls.get(k, 0) + v
            for k, v in seen["payload_bytes"].items():
                payload[k] = payload.get(k, 0) + v
        assert calls == tp_step_calls(size.n_layer, sp)
        assert payload == tp_step_payloads(size.n_layer, tokens, size.d_model, r["tp"], 4, sp)
        checked.add((r["strategy"], sp))
    assert checked == {("tp-scratch", False), ("tp-scratch", True), ("tp", False)}


def counted_flops(layers: list[nn.Module], x: torch.Tensor) -> int:
    """FLOPs torch counts for forward and backward through `layers` in turn."""
    with FlopCounterMode(display=False) as counter:
        y = x
        for layer in layers:
            y = layer(y)
        y.sum().backward()
    return counter.get_total_flops()


def test_tp_comm_over_compute_is_a_blocks_counted_flops_against_its_four_all_reduces():
    h, tokens, t, value_bytes, flops_per_s, bandwidth = 64, 32, 4, 2, 1e12, 1e10
    x = torch.randn(tokens, h, requires_grad=True)
    attention = counted_flops([nn.Linear(h, 3 * h, bias=False)], x) + \
        counted_flops([nn.Linear(h, h, bias=False)], x)  # the projections; the scores are not split
    mlp = counted_flops([nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)], x)
    compute_s = (attention + mlp) / t / flops_per_s
    comm_s = 4 * sent_bytes("all_reduce", tokens * h * value_bytes, t) / bandwidth
    assert math.isclose(comm_s / compute_s, tp_comm_over_compute(t, h, flops_per_s, bandwidth, value_bytes))
    even = tp_even_width(t, flops_per_s, bandwidth, value_bytes)
    assert math.isclose(tp_comm_over_compute(t, even, flops_per_s, bandwidth, value_bytes), 1.0)


@pytest.mark.usefixtures("committed_records")
def test_tp_mlp_even_width_is_where_the_split_pays_for_its_all_reduces():
    tokens, t, rate, alpha, beta = 256, 2, 2e10, 3e-4, 2e-9
    w = 48
    mlp = counted_flops([nn.Linear(w, 4 * w, bias=False), nn.Linear(4 * w, w, bias=False)],
                        torch.randn(tokens, w, requires_grad=True))
    per_w2 = mlp / (w * w)  # torch's count, per width squared: the formula's 48 per token
    assert per_w2 == 48 * tokens
    assert all(r["flops"] == 48 * r["width"] ** 2 * r["tokens"] for r in committed("tp_width"))
    even = tp_mlp_even_width(tokens, t, rate, alpha, beta)
    one = per_w2 * even ** 2 / rate
    split = one / t + 2 * (alpha + beta * sent_bytes("all_reduce", 4 * tokens * even, t))
    assert math.isclose(one, split)


def test_a_pipelines_action_cost_is_recovered_from_steps_that_pay_it():
    from multigpu.estimator.formulas import bubble_fraction, bubble_with_action_cost, pipeline_action_cost

    pair, cost = 0.06, 0.003
    runs = [(p, m, pair, (m + p - 1) * (pair + cost)) for p in (2, 4) for m in (1, 4, 16)]
    assert pipeline_action_cost(runs) == pytest.approx(cost)
    assert bubble_with_action_cost(4, 8, pair, 0.0) == pytest.approx(bubble_fraction(4, 8))
    step = (8 + 4 - 1) * (pair + cost)
    assert bubble_with_action_cost(4, 8, pair, cost) == pytest.approx(1 - 8 * pair / step)
