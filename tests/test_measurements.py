"""Measurements against formulas and PyTorch's own accounting.

Memory: fp32 weights take 4 bytes per parameter; optimizer state is whatever PyTorch's
optimizer allocates for the model (0 for SGD, one buffer for momentum, two for AdamW).
Communication: data parallelism all-reduces every gradient exactly once per step, so each
rank's all-reduce payload is 4 bytes x parameters, and a ring all-reduce sends
2(N-1)/N of it. CommCounter is checked against the tensors handed to torch.distributed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from multigpu.comm import CommCounter
from multigpu.config import RunConfig
from multigpu.launch import launch
from multigpu.models import build_model, parameter_count
from multigpu.strategies import build_optimizer
from series import RunCache

P = parameter_count("gpt-tiny")


def _config(strategy: str, world_size: int = 1, optimizer: str = "sgd", bucket_cap_mb: float = 25.0) -> RunConfig:
    return RunConfig(strategy=strategy, world_size=world_size, model="gpt-tiny", dtype="fp32", steps=3,
                     optimizer=optimizer, bucket_cap_mb=bucket_cap_mb)


def _activations_config(strategy: str, world_size: int, batch: int) -> RunConfig:
    return RunConfig(strategy=strategy, world_size=world_size, model="gpt-tiny", steps=2, global_batch_size=batch,
                     dataset="dummy")


def _planned() -> list[RunConfig]:
    """Every setting the tests below read: run as series, one per process count (tests/series.py)."""
    return [*(_config("single", optimizer=o) for o in ("sgd", "sgd-momentum", "adam", "adamw")),
            _activations_config("single", 1, 2), _activations_config("single", 1, 8), _activations_config("ddp", 2, 4),
            *(_config(s, 2, bucket_cap_mb=b) for s, b in DATA_PARALLEL),
            *(_config(s, n, optimizer="adamw") for n in (2, 4) for s in ZERO_FORMULA),
            *(_config(s, n) for n in (2, 4) for s in ZERO_FORMULA)]


_runs = RunCache(_planned)


def record(strategy: str, world_size: int = 1, optimizer: str = "sgd", bucket_cap_mb: float = 25.0) -> dict:
    """One launched run per distinct setting, shared by the tests of this module."""
    return _runs(_config(strategy, world_size, optimizer, bucket_cap_mb))


def torch_optimizer_state_bytes(optimizer: str) -> int:
    """Bytes of every state tensor PyTorch's optimizer keeps for gpt-tiny after one step."""
    model = build_model("gpt-tiny")
    opt = build_optimizer(model.parameters(), RunConfig(optimizer=optimizer))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


# -- memory ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer, state_buffers", [("sgd", 0), ("sgd-momentum", 1), ("adam", 2), ("adamw", 2)])
def test_single_memory_params_and_optimizer(optimizer, state_buffers):
    memory = record("single", optimizer=optimizer)["peak_memory_bytes_by_rank"][0]
    assert memory["params"] == 4 * P  # fp32 weights, the tied head counted once
    expected = torch_optimizer_state_bytes(optimizer)
    assert memory["optimizer"] == expected
    # the formula: state_buffers fp32 copies of the weights (+ Adam's scalar step counters)
    n_tensors = len(list(build_model("gpt-tiny").parameters()))
    assert expected == state_buffers * 4 * P + (4 * n_tensors if optimizer.startswith("adam") else 0)


# -- communication -----------------------------------------------------------------------

DATA_PARALLEL = [("ddp", 25.0), ("ddp-scratch", 25.0), ("ddp-scratch", 0.01)]
IDS = ["ddp", "ddp-scratch", "ddp-scratch-small-buckets"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy, bucket_cap_mb", DATA_PARALLEL, ids=IDS)
def test_data_parallel_all_reduces_every_gradient_once(strategy, bucket_cap_mb):
    n = 2
    rec = record(strategy, n, bucket_cap_mb=bucket_cap_mb)
    assert rec["parameters"] == P
    for r in range(n):
        assert rec["comm_payload_bytes_per_step_by_rank"][r]["all_reduce"] == 4 * P
        assert rec["comm_bytes_per_step_by_rank"][r]["all_reduce"] == pytest.approx(2 * (n - 1) / n * 4 * P)
        calls = rec["comm_calls_per_step_by_rank"][r]["all_reduce"]
        if bucket_cap_mb * 2**20 > 4 * P:
            assert calls == 1  # the whole model fits in one bucket
        else:
            assert calls > 1
        # every rank holds a full replica of the weights
        assert rec["peak_memory_bytes_by_rank"][r]["params"] == 4 * P


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_steady_state_step_only_all_reduces():
    rec = record("ddp", 2)
    for calls in rec["comm_calls_per_step_by_rank"]:
        assert set(calls) == {"all_reduce"}


# -- CommCounter, unit --------------------------------------------------------------------

def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_comm_counter_one_process(one_process_group):
    """Payload = bytes of the tensor handed to the collective; one rank sends nothing."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    x = torch.ones(10)
    shard, gathered = torch.ones(6, dtype=torch.float64), torch.empty(6, dtype=torch.float64)
    full, out = torch.ones(7), torch.empty(7)
    ids = torch.arange(3)
    with CommCounter(1) as comm:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(gathered, shard)
        dist.reduce_scatter_tensor(out, full)
        dist.broadcast(ids, src=0)
        dist.all_reduce(torch.ones(5, dtype=torch.bfloat16), async_op=True).wait()
    assert dict(comm.calls) == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}
    assert dict(comm.payload_bytes) == {
        "all_reduce": nbytes(x) + 5 * 2, "all_gather": nbytes(shard), "reduce_scatter": nbytes(full),
        "broadcast": nbytes(ids)}
    assert comm.sent_bytes == {k: 0.0 for k in comm.payload_bytes}
    # outside the block nothing is counted
    dist.all_reduce(x)
    assert comm.calls["all_reduce"] == 2


THREE_RANKS = r"""
import json, sys, warnings
import torch, torch.distributed as dist
from multigpu.comm import CommCounter
warnings.filterwarnings("ignore")
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
ops = {
    "all_reduce": lambda: dist.all_reduce(torch.ones(10)),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(18, dtype=torch.float64),
                                                                  torch.ones(6, dtype=torch.float64)),
    "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(3)], torch.ones(4)),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(7), torch.ones(21)),
    "broadcast": lambda: dist.broadcast(torch.arange(3), src=0),
}
out = {}
for name, op in ops.items():
    with CommCounter(3) as comm:
        op()
    out[name] = [dict(comm.calls), dict(comm.payload_bytes), comm.sent_bytes]
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_comm_counter_three_processes(tmp_path):
    """On 3 ranks, where a collective's input and output differ in size: all-gather's
    payload is this rank's shard, reduce-scatter's the full input; bytes sent follow the
    ring algorithm: all-reduce 2(N-1)/N, all-gather (N-1) x shard, reduce-scatter (N-1)/N,
    broadcast 1 x payload."""
    import multigpu

    script = tmp_path / "three_ranks.py"
    script.write_text(THREE_RANKS)
    src = os.path.dirname(os.path.dirname(multigpu.__file__))
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    got = json.loads(outputs[0][0])
    n = 3
    expected = {  # name: (kind, payload bytes, ring factor)
        "all_reduce": ("all_reduce", 10 * 4, 2 * (n - 1) / n),
        "all_gather_into_tensor": ("all_gather", 6 * 8, n - 1),
        "all_gather": ("all_gather", 4 * 4, n - 1),
        "reduce_scatter_tensor": ("reduce_scatter", 21 * 4, (n - 1) / n),
        "broadcast": ("broadcast", 3 * 8, 1.0),
    }
    for name, (kind, payload, factor) in expected.items():
        calls, payload_bytes, sent = got[name]
        assert calls == {kind: 1}, name
        assert payload_bytes == {kind: payload}, name
        assert sent[kind] == pytest.approx(factor * payload), name


@pytest.mark.slow
def test_saved_activations_grow_with_the_batch_and_split_over_ranks():
    """Saved activations are proportional to the batch (4x the samples, 4x the bytes), and a
    data-parallel rank saves exactly what one process saves for the same per-rank batch."""

    def saved(strategy, world_size, batch):
        return _runs(_activations_config(strategy, world_size, batch))["saved_activation_bytes_by_rank"]

    (small,), (large,) = saved("single", 1, 2), saved("single", 1, 8)
    assert large / small == pytest.approx(4, rel=0.02)
    assert saved("ddp", 2, 4) == [small, small]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/net/dev"), reason="needs Linux's loopback byte counter")
def test_bytes_on_the_wire_follow_the_ring_rule():
    """What really crossed the loopback in one DDP step, per rank, is the ring all-reduce's
    2(N-1)/N x gradient bytes (TCP/IP headers allow a little more)."""
    for world_size in (2, 4):
        rec = record("ddp", world_size)
        rule = 2 * (world_size - 1) / world_size * 4 * P
        per_rank = rec["loopback_bytes_per_step"] / world_size
        assert 0.98 <= per_rank / rule <= 1.15, (world_size, per_rank, rule)


@pytest.mark.slow
def test_data_parallel_primary_replica_holds_more():
    """dp: every replica saves what one device saves for its share of the batch, less the
    loss's saved log-probabilities, which the primary saves for the whole batch; the primary
    alone holds the optimizer state and the gathered outputs with their gradient."""
    single = launch(RunConfig(model="gpt-tiny", steps=3, global_batch_size=4, dataset="dummy"), progress=False)
    dp = launch(RunConfig(strategy="dp", world_size=2, model="gpt-tiny", steps=3, global_batch_size=8,
                          optimizer="sgd-momentum", dataset="dummy"), progress=False)
    primary, replica = dp["peak_memory_bytes_by_rank"]
    logits = 4 * 64 * 128 * 4  # one replica's output: batch 4 x seq 64 x vocab 128, fp32
    assert replica["activations"] + logits == pytest.approx(single["saved_activation_bytes_by_rank"][0], rel=0.01)
    labels = 8 * 64 * 8  # the whole batch's int64 labels, saved with the log-probabilities
    assert primary["activations"] - replica["activations"] == pytest.approx(2 * logits + labels, rel=0.001)
    assert primary["optimizer"] == 4 * P and replica["optimizer"] == 0
    assert primary["other"] - replica["other"] == 2 * 2 * logits
    assert dp["strategy_report"]["implementation"].startswith("from scratch")


# -- sharding: what each rank holds, and what it sends -----------------------------------

# The ZeRO paper's model states per rank, for fp32 training with AdamW (parameters 4 bytes,
# gradients 4 bytes, optimizer state K = 8 bytes per parameter), in units of 4 Psi bytes:
# (params, grads, optimizer) as functions of N.
ZERO_FORMULA = {
    "ddp": lambda n: (1, 1, 2),
    "zero1": lambda n: (1, 1, 2 / n),  # P_os
    "zero1-torch": lambda n: (1, 1, 2 / n),
    "zero2": lambda n: (1, 1 / n, 2 / n),  # P_os+g
    "zero3": lambda n: (1 / n, 1 / n, 2 / n),  # P_os+g+p
    "fsdp": lambda n: (1 / n, 1 / n, 2 / n),
    "fsdp1": lambda n: (1 / n, 1 / n, 2 / n),
}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", list(ZERO_FORMULA))
def test_model_states_follow_the_zero_formulas(strategy, world_size):
    """Measured by storage (each buffer once, a DTensor by its local shard): the bytes each
    rank holds between steps, per category, averaged over ranks, against the formula.
    Padding to equal shards and whole-tensor shards (ZeroRedundancyOptimizer) allow 2%."""
    rec = record(strategy, world_size, optimizer="adamw")
    held = rec["model_state_bytes_by_rank"]
    for i, category in enumerate(("params", "grads", "optimizer")):
        mean = sum(h[category] for h in held) / world_size
        expected = ZERO_FORMULA[strategy](world_size)[i] * 4 * P
        assert mean == pytest.approx(expected, rel=0.02, abs=64), (category, mean / (4 * P))
    if strategy in ("zero1", "zero2", "zero3"):  # flat, evenly padded shards: every rank the same
        assert all(h == held[0] for h in held)


def sent_per_step(rec) -> float:
    """Ring-rule bytes rank 0 sends per step, all kinds together."""
    return sum(rec["comm_bytes_per_step_by_rank"][0].values())


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_per_step_follow_the_zero_paper(world_size):
    """DDP and the from-scratch ZeRO-1 and ZeRO-2 send the same (a reduce-scatter and an
    all-gather of every parameter are an all-reduce); ZeRO-3 and FSDP gather the parameters a second time for
    backward: about 1.5 times DDP's bytes (less the root unit, which stays gathered)."""
    ddp = sent_per_step(record("ddp", world_size))
    assert ddp == pytest.approx(2 * (world_size - 1) / world_size * 4 * P, rel=1e-6)
    for strategy in ("zero1", "zero2"):
        assert sent_per_step(record(strategy, world_size)) == pytest.approx(ddp, rel=0.02), strategy
    # PyTorch's ZeroRedundancyOptimizer rides on DDP: a full all-reduce of the gradients,
    # then every updated parameter broadcast from the rank that owns it
    payload = record("zero1-torch", world_size)["comm_payload_bytes_per_step_by_rank"][0]
    assert payload == {"all_reduce": 4 * P, "broadcast": 4 * P}
    for strategy in ("zero3", "fsdp", "fsdp1"):
        ratio = sent_per_step(record(strategy, world_size)) / ddp
        assert 1.25 <= ratio <= 1.52, (strategy, ratio)


# The ZeRO paper's Table 1: model-state memory per device in GB, Psi = 7.5B parameters,
# mixed-precision Adam, for N_d = 1, 4, 16, 64, 256, 1024 devices.
ZERO_TABLE_1 = {
    0: [120, 120, 120, 120, 120, 120],
    1: [120, 52.5, 35.6, 31.4, 30.4, 30.1],
    2: [120, 41.3, 21.6, 16.6, 15.4, 15.1],
    3: [120, 30, 7.5, 1.88, 0.47, 0.12],
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_formula_reproduces_the_papers_table_1(stage):
    from multigpu.memory import zero_model_states

    for n, printed in zip([1, 4, 16, 64, 256, 1024], ZERO_TABLE_1[stage]):
        total_gb = sum(zero_model_states(int(7.5e9), n, stage, "adamw", "bf16-master").values()) / 1e9
        scale = 10 ** len(str(printed).partition(".")[2])  # the paper's printed precision
        assert math.floor(total_gb * scale + 0.5) / scale == printed, (stage, n, total_gb)  # rounded half up
