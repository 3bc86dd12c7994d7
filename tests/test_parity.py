"""Parity: a data-parallel strategy must train exactly like one process.

Reference: the `single` strategy (one process, the whole global batch), from the same seed
on the same global batches. `multigpu.check.check` runs both and compares the trained
weights and the per-step losses; sums in another order differ only in the last bits, so
we ask for agreement within 1e-5 in fp32.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from multigpu.check import BF16_TOLERANCE, check, check_series
from multigpu.config import SHARDED, STRATEGY_TABLE, RunConfig
from multigpu.launch import launch, launch_series

TOLERANCE = 1e-5
STEPS = 3
SERIES_TIMEOUT = 900  # seconds: a module's first parity test runs every case of the module (`parity`)


def assert_parity(result: dict, strategy: str, world_size: int, tolerance: float = TOLERANCE) -> None:
    assert result["strategy"] == strategy
    assert result["world_size"] == world_size
    assert result["steps"] == STEPS
    assert len(result["loss"]) == len(result["reference_loss"]) == STEPS
    # the reference really trained, so agreement is not agreement of untouched weights
    assert result["reference_loss"][-1] < result["reference_loss"][0]
    assert result["max_abs_param_diff"] <= tolerance, result
    assert result["max_abs_loss_diff"] <= tolerance, result
    assert result["passed"] is True
    # the record states the grid the run made: its degrees tile the processes (dp: the replicas)
    grid = result["grid"]
    assert grid["dp"] * grid["pp"] * grid["tp"] * grid.get("cp", 1) == world_size, grid
    spans = STRATEGY_TABLE[strategy].spans
    if spans in ("tp", "pp", "cp"):  # the strategy's own dimension is really cut
        assert grid[spans] > 1, grid


_results: dict[str, object] = {}


def _key(case: tuple, tolerance: float) -> str:
    return json.dumps([*case, tolerance])


CASES: dict[str, tuple] = {}  # a test function's name -> (its case_of, its tolerance)


def cases(case_of, tolerance: float = TOLERANCE):
    """Registers a test function's cases: `case_of(**its parameters)` -> (strategy, world_size, overrides)."""
    def register(test):
        CASES[test.__name__] = (case_of, tolerance)
        return test
    return register


def parity(request) -> dict:
    """`check` of this test's case (`cases`). On the first call, every case of every registered test of this
    module that this session runs, with the same tolerance, is checked in one series per process count
    (check.check_series: one torchrun for them all, instead of one per test function and process count); a
    case whose run failed raises its own error here."""
    case_of, tolerance = CASES[request.node.originalname]
    case = case_of(**request.node.callspec.params)
    if _key(case, tolerance) not in _results:
        siblings = [CASES[item.originalname][0](**item.callspec.params) for item in request.session.items
                    if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
                    and getattr(item, "originalname", None) in CASES and CASES[item.originalname][1] == tolerance]
        todo = [c for c in dict.fromkeys([case, *siblings], None) if _key(c, tolerance) not in _results]
        for c, result in zip(todo, check_series([(s, n, json.loads(o)) for s, n, o in todo], steps=STEPS,
                                                tolerance=tolerance)):
            _results[_key(c, tolerance)] = result
    result = _results[_key(case, tolerance)]
    if isinstance(result, Exception):
        raise result
    return result


def _case(strategy: str, world_size: int, **overrides) -> tuple:
    """A hashable case: the overrides as JSON."""
    return strategy, world_size, json.dumps(overrides, sort_keys=True)


# DeepSpeed's stage 3 keeps parameters under 100,000 elements whole on every rank, which is
# every parameter of the test models: make it shard them all, or the test shards nothing
SHARD_EVERYTHING = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "ddp-scratch", "dp", *SHARDED])
@cases(lambda strategy, world_size: _case(
    strategy, world_size, dtype="fp32", extra=SHARD_EVERYTHING if strategy == "deepspeed-zero3" else {}))
def test_matches_single_device(strategy, world_size, request):
    """N processes x (global batch / N) == 1 process x global batch, in fp32."""
    result = parity(request)
    assert_parity(result, strategy, world_size)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("attention, balance", [("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag"),
                                                ("ulysses", "zigzag")])
@cases(lambda attention, balance, world_size: _case(
    "cp-scratch", world_size, extra={"cp_attention": attention, "cp_balance": balance}))
def test_context_parallel_matches_single_device(attention, balance, world_size, request):
    """cp-scratch on 2 and 4 ranks, each rank a part of every sequence (gpt-tiny, 64 tokens: the
    causal mask makes the layouts' work differ, not their result)."""
    result = parity(request)
    assert_parity(result, "cp-scratch", world_size)
    assert result["grid"]["cp"] == world_size


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("strategy, overrides", [
    ("cp-scratch", dict(cp=2, grad_accum_steps=2)),  # dp 2 x cp 2, gradients averaged over all four
    ("fsdp", dict(cp=2)),  # FSDP over the flattened dp x cp ranks
    ("fsdp", dict(cp=4, extra={"cp_attention": "ulysses"})),
], ids=["cp2-dp2-accum2", "fsdp-dp2-cp2", "fsdp-cp4-ulysses"])
@cases(lambda strategy, overrides: _case(strategy, 4, **overrides))
def test_context_parallel_composes_with_data_parallelism(strategy, overrides, request):
    result = parity(request)
    assert_parity(result, strategy, 4)
    assert result["grid"]["cp"] == overrides["cp"]


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("strategy, world_size, overrides", [
    ("fsdp", 4, dict(tp=2, cp=2)),  # the ring over each rank's own heads
    ("fsdp", 4, dict(tp=2, cp=2, extra={"sequence_parallel": True, "cp_attention": "ulysses"})),
    ("fsdp", 8, dict(tp=2, cp=2, grad_accum_steps=2, activation_checkpointing=True)),  # dp 2 x cp 2 x tp 2
    ("pp-1f1b", 4, dict(pp=2, cp=2, grad_accum_steps=2, model="gpt-mini")),  # a cp line in each stage
    ("pp-gpipe", 8, dict(pp=2, cp=2, tp=2, grad_accum_steps=2, model="gpt-mini")),  # pp x cp x tp
], ids=["fsdp-tp2-cp2", "fsdp-tp2-cp2-sp-ulysses", "fsdp-dp2-cp2-tp2-accum2-checkpointed", "1f1b-pp2-cp2",
        "gpipe-pp2-cp2-tp2"])
@cases(lambda strategy, world_size, overrides: _case(strategy, world_size, **overrides))
def test_context_parallel_composes_with_model_parallelism(strategy, world_size, overrides, request):
    """CP with TP and PP in torchtitan's order (compose.py): the stages cut, the layers cut over tp, the blocks
    sharded over the dp x cp ranks, the sequence cut last (a pipeline's batches before its schedule's step);
    each rank's attention holds its heads, whole for its part of the sequence, and the ring (or Ulysses'
    exchange) runs on them unchanged."""
    result = parity(request)
    assert_parity(result, strategy, world_size)
    assert result["grid"]["cp"] == 2 and all(result["grid"][d] == overrides.get(d, 1) for d in ("tp", "pp"))


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("routing", [
    dict(moe_top_k=2),  # no capacity: no token dropped, exact
    dict(moe_top_k=1),  # Switch's routing: the router learns through the chosen expert's score alone
    dict(moe_top_k=2, moe_capacity_factor=0.5),  # capacity binds: about half the assignments dropped
], ids=["top2", "top1", "top2-capacity0.5"])
@cases(lambda routing, world_size: _case("ep-scratch", world_size, model="gpt-moe-tiny",
    extra=routing))
def test_expert_parallel_matches_single_device(routing, world_size, request):
    """ep-scratch with every rank its own share of the experts (ep = dp = world size): the same
    weights and losses as one device, every layer's tokens per expert the same at every forward, and
    where capacity binds, the same tokens dropped (counted over the whole batch)."""
    result = parity(request)
    assert_parity(result, "ep-scratch", world_size)
    assert result["grid"]["ep"] == world_size
    assert result["moe_same_routing"] == {"tokens_per_expert": True, "dropped": True}
    if "moe_capacity_factor" in routing:
        assert result["moe_dropped"] == result["reference_moe_dropped"] > 0
    else:
        assert result["moe_dropped"] == 0


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("strategy, world_size, overrides", [
    ("ep-scratch", 4, dict(ep=2, grad_accum_steps=2, bucket_cap_mb=0.01)),  # two copies of each half of the experts
    ("ep-scratch", 4, dict(ep=1, extra={"moe_capacity_factor": 1.0})),  # plain data parallel of the same model
    ("ep-scratch", 4, dict(ep=4, activation_checkpointing=True)),  # the all-to-alls again in backward's recompute
    ("ep-scratch", 4, dict(ep=2, activation_checkpointing="selective")),
    # FSDP x EP: each slice of the experts sharded over its copies, the rest over every rank
    ("fsdp", 2, dict(ep=2)),  # a slice's copies: a mesh of one rank
    ("fsdp", 4, dict(ep=2, grad_accum_steps=2, activation_checkpointing=True)),
    ("fsdp", 4, dict(ep=4, extra={"moe_capacity_factor": 0.5})),
    ("fsdp", 2, dict(ep=1)),  # FSDP of a mixture of experts: its counts summed over the ranks
    # DeepSpeed-MoE's layer and engine: no capacity (nothing dropped); the package's balancing loss in place of
    # the gate's own (GShard's per rank), at the default coefficient, and off once
    ("deepspeed-moe", 2, dict(ep=2)),
    ("deepspeed-moe", 4, dict(ep=4, activation_checkpointing=True)),
    ("deepspeed-moe", 4, dict(ep=2, grad_accum_steps=2, extra={"moe_aux_loss_coef": 0.0, "moe_top_k": 1})),
], ids=["dp4-ep2-accum2", "dp4-ep1-capacity1", "dp4-ep4-checkpointed", "dp4-ep2-selective", "fsdp2-ep2",
        "fsdp4-ep2-accum2-checkpointed", "fsdp4-ep4-capacity0.5", "fsdp2-ep1", "deepspeed2-ep2",
        "deepspeed4-ep4-checkpointed", "deepspeed4-ep2-accum2-top1"])
@cases(lambda strategy, world_size, overrides: _case(strategy, world_size, model="gpt-moe-tiny",
    **overrides))
def test_expert_parallel_inside_data_parallel(strategy, world_size, overrides, request):
    """ep divides dp: the experts' copies sum their gradients and divide by dp (not by the copies)."""
    result = parity(request)
    assert_parity(result, strategy, world_size)
    assert result["grid"].get("ep", 1) == overrides["ep"]
    assert all(result["moe_same_routing"].values())


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize(
    "strategy, overrides",
    [
        ("ddp", dict(grad_accum_steps=2)),
        # 0.01 MiB buckets: every large tensor gets its own bucket, so the all-reduces
        # must be launched in order and each gradient copied back from the right offset
        ("ddp-scratch", dict(grad_accum_steps=2, bucket_cap_mb=0.01)),
        # dp's backward runs when the gathered outputs get their gradient: once per micro-batch
        ("dp", dict(grad_accum_steps=2)),
        # sharded gradients are reduced every micro-batch and summed in the shard
        ("zero2", dict(grad_accum_steps=2)),
        ("zero3", dict(grad_accum_steps=2)),
        ("fsdp", dict(grad_accum_steps=2)),
        ("deepspeed-zero2", dict(grad_accum_steps=2)),
    ],
    ids=["ddp-accum2", "ddp-scratch-accum2-small-buckets", "dp-accum2", "zero2-accum2", "zero3-accum2",
         "fsdp-accum2", "deepspeed-zero2-accum2"],
)
@cases(lambda strategy, overrides: _case(strategy, 2, **overrides))
def test_matches_single_device_with_grad_accumulation(strategy, overrides, request):
    """2 micro-batches per rank with no_sync() on the first == one big batch on one process."""
    result = parity(request)
    assert_parity(result, strategy, 2)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize(
    "strategy, overrides",
    [
        ("ddp", dict(model="t5-tiny")),  # the sources' model family: Hugging Face T5
        ("ddp-scratch", dict(model="t5-tiny", activation_checkpointing=True)),
        ("dp", dict(model="t5-tiny", dataset="dummy")),  # T5's loss computed outside the model
        # T5 hands one position-bias tensor through all its blocks: each block is still
        # gathered once for its backward
        ("zero3", dict(model="t5-tiny", dataset="dummy")),
        ("fsdp1", dict(model="t5-tiny", dataset="dummy")),  # the sources' setting: T5Block units
        ("deepspeed-zero3", dict(model="t5-tiny", dataset="dummy", extra=SHARD_EVERYTHING)),
        ("fsdp", dict(extra={"reshard_after_forward": False})),  # ZeRO-2-like FSDP
        ("ddp-scratch", dict(model="t5-tiny", activation_checkpointing="selective")),
    ],
    ids=["ddp-t5", "ddp-scratch-t5-checkpointing", "dp-t5", "zero3-t5", "fsdp1-t5", "deepspeed-zero3-t5",
         "fsdp-no-reshard", "ddp-scratch-t5-selective"],
)
@cases(lambda strategy, overrides: _case(strategy, 2, **overrides))
def test_matches_single_device_other_models_and_options(strategy, overrides, request):
    """T5 (encoder-decoder), activation checkpointing and ZeRO-2-like FSDP change nothing about parity."""
    result = parity(request)
    assert_parity(result, strategy, 2)


# AdamW divides each weight's gradient by its own running size, so every weight moves by about lr a step,
# whatever its gradient's size. A gradient that is zero in exact arithmetic is rounding noise instead (a key's
# bias: softmax ignores a shift shared by every key), and the noise differs between a sum in another order and
# one device's: such a weight moves by a few hundredths of lr in a direction the noise picks (2e-5 at lr 1e-3,
# measured on gpt-tiny's synthetic data). A wrong gradient moves a weight by about lr, so lr / 10 tells them apart.
ADAMW_LR = 1e-3
ADAMW_TOLERANCE = ADAMW_LR / 10


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize(
    "strategy, overrides",
    [
        ("ddp-scratch", dict(activation_checkpointing=True)),
        # recomputation inside backward must not free a block that backward still needs
        ("zero3", dict(activation_checkpointing=True)),
        ("fsdp", dict(activation_checkpointing=True)),
        # selective recomputation: the products' outputs kept, the rest (and the output projections) run again
        ("fsdp", dict(activation_checkpointing="selective")),
    ],
    ids=["ddp-scratch-gpt-checkpointing-adamw", "zero3-checkpointing-adamw", "fsdp-checkpointing-adamw",
         "fsdp-selective-adamw"],
)
@cases(lambda strategy, overrides: _case(strategy, 2, optimizer="adamw", lr=ADAMW_LR, **overrides), ADAMW_TOLERANCE)
def test_matches_single_device_with_adamw(strategy, overrides, request):
    """Recomputation with AdamW's sharded state: parity within lr / 10 (ADAMW_TOLERANCE)."""
    result = parity(request)
    assert_parity(result, strategy, 2, tolerance=ADAMW_TOLERANCE)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "deepspeed-zero2"])
@cases(lambda strategy: _case(strategy, 2, dtype="bf16-mixed"), BF16_TOLERANCE)
def test_mixed_precision_fsdp_stays_close_to_single(strategy, request):
    """bf16 compute with fp32 reduction (MixedPrecisionPolicy / MixedPrecision / DeepSpeed's
    torch_autocast with fp32 weights) against one process under bf16 autocast: the same
    arithmetic up to bf16 rounding, so 1e-3, not 1e-5."""
    result = parity(request)
    assert result["passed"], result
    assert result["reference_loss"][-1] < result["reference_loss"][0]


def _trained_params(tmp_path, *changes: dict) -> list[dict[str, torch.Tensor]]:
    """The trained weights of `single` runs with the settings `check` uses, each with its changes
    (one series: launch.launch_series)."""
    cfg = RunConfig(strategy="single", model="gpt-tiny", global_batch_size=8, steps=STEPS,
                    optimizer="sgd-momentum", lr=0.05, track_memory=False)
    launch_series([cfg.replace(**c) for c in changes], params_dir=tmp_path)
    return [torch.load(tmp_path / f"run{i}.pt") for i in range(len(changes))]


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_weight_comparison_detects_real_differences(tmp_path):
    """The parity tolerance is far below the differences that real bugs make.

    Two `single` runs stand in for broken strategies: another seed (replicas that did
    not start from the same weights) and twice the learning rate (gradients summed over
    2 ranks instead of averaged, which for SGD is exactly a doubled step)."""
    reference, other_seed, doubled_step = _trained_params(tmp_path, {}, {"seed": 1}, {"lr": 0.1})
    assert _max_abs_diff(reference, other_seed) > 100 * TOLERANCE
    assert _max_abs_diff(reference, doubled_step) > 100 * TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (NCCL); the CPU path above is what CI runs")
@pytest.mark.parametrize("strategy", ["ddp", "ddp-scratch", "dp"])
def test_matches_single_device_on_gpus(strategy):
    """The same parity over NCCL on CUDA GPUs (the reference runs on one GPU)."""
    result = check(strategy, 2, steps=STEPS, tolerance=TOLERANCE, device="cuda", progress=False)
    assert_parity(result, strategy, 2)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["tp-scratch", "tp"])
@cases(lambda strategy, world_size, sequence_parallel: _case(
    strategy, world_size, extra={"sequence_parallel": sequence_parallel}))
def test_tensor_parallel_matches_single_device(strategy, world_size, sequence_parallel, request):
    """tp ranks, each holding 1/tp of every weight matrix and all seeing the whole batch,
    train like one process: the sums of partial products differ only in their last bits."""
    result = parity(request)
    assert_parity(result, strategy, world_size)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("strategy", ["tp-scratch", "tp"])
@cases(lambda strategy: _case(strategy, 2, grad_accum_steps=2, activation_checkpointing=True,
    extra={"sequence_parallel": True}))
def test_tensor_parallel_with_accumulation_and_checkpointing(strategy, request):
    """Two micro-batches, each block recomputed in backward (its collectives issued again),
    sequence parallelism on: still the single device's training."""
    result = parity(request)
    assert_parity(result, strategy, 2)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_tensor_parallel_on_a_hugging_face_model(tmp_path):
    """A reader's own model: a Llama (grouped-query attention, rotary positions, gated MLP)
    built from a config.json, split by its own base_model_tp_plan."""
    from multigpu.hf import write_tiny_llama_config

    path = str(write_tiny_llama_config(tmp_path / "config.json"))
    result = check("tp", 2, steps=STEPS, tolerance=TOLERANCE, progress=False, model=path)
    assert_parity(result, "tp", 2)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_a_hugging_face_mixtral_over_expert_parallel_ranks(tmp_path):
    """A Hugging Face Mixtral from its config.json: its sparse blocks handed to DeepSpeed-MoE (the
    router as the library's gate, expert e's rows as its ep rank's local expert), ep 2 inside dp 4,
    against the unchanged model on one device."""
    from multigpu.hf import TINY_MIXTRAL, write_tiny_llama_config

    path = str(write_tiny_llama_config(tmp_path / "config.json", TINY_MIXTRAL))
    result = check("deepspeed-moe", 4, steps=STEPS, tolerance=TOLERANCE, progress=False, model=path, ep=2,
                   grad_accum_steps=2, seq_len=32)
    assert_parity(result, "deepspeed-moe", 4)
    assert result["grid"]["ep"] == 2


PIPELINES = ["pp-naive", "pp-gpipe-scratch", "pp-1f1b-scratch", "pp-gpipe", "pp-1f1b", "pp-interleaved", "pp-zbv",
             "pp-dualpipev"]


_DEEP = Path(tempfile.mkdtemp(prefix="multigpu-test-deep-gpt-"))
atexit.register(shutil.rmtree, _DEEP, True)


def _deep_gpt(n_layer: int) -> str:
    """A gpt2 config.json (the package's GPT) with `n_layer` tiny blocks: enough stages for
    2 per rank on 4 ranks, at gpt-tiny's width."""
    path = _DEEP / f"gpt-{n_layer}-blocks.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 128, "n_layer": n_layer, "n_head": 4,
                                "n_embd": 64, "n_positions": 64}))
    return str(path)


def _pipeline_case(strategy: str, world_size: int) -> tuple:
    stages = world_size * (2 if strategy in ("pp-interleaved", "pp-zbv", "pp-dualpipev") else 1)
    model = "gpt-tiny" if stages <= 2 else "gpt-mini" if stages <= 4 else _deep_gpt(stages)
    micro = max(4, stages)
    return _case(strategy, world_size, model=model, grad_accum_steps=micro,
                 global_batch_size=micro * 2 if micro > 4 else 8)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", PIPELINES)
@cases(_pipeline_case)
def test_pipeline_matches_single_device(strategy, world_size, request):
    """p stages (2 per rank for the interleaved and V schedules), as many micro-batches as
    stages and at least 4, the head tied to the embedding at the other end of the pipeline
    (its gradient summed between the first and last stage): one device's training."""
    result = parity(request)
    assert_parity(result, strategy, world_size)


# Compositions on one grid, applied in the order of strategies/compose.py. 8 processes on
# two cores are slow but fine with gpt-tiny (one 3D run, about 20 s).
COMPOSITIONS = [
    ("fsdp", 4, dict(tp=2)),  # 2D: FSDP over 2 replicas of a 2-way tensor-parallel model
    ("fsdp", 4, dict(tp=2, extra={"sequence_parallel": True})),
    ("fsdp", 4, dict(extra={"replicas": 2})),  # HSDP: sharded over 2 ranks, 2 replicas of that
    ("ddp-scratch", 4, dict(tp=2, extra={"sequence_parallel": True})),  # 2D from scratch
    ("pp-1f1b", 4, dict(tp=2, grad_accum_steps=2)),  # PP x TP
    ("pp-1f1b", 4, dict(dp=2, grad_accum_steps=2)),  # PP x FSDP
    ("pp-zbv", 4, dict(tp=2, grad_accum_steps=4, model="gpt-mini")),  # V placement: a tied copy pair on one rank
    # 3D, with checkpointing (step 3 of the order, between TP and FSDP)
    ("pp-1f1b", 8, dict(tp=2, dp=2, grad_accum_steps=2, activation_checkpointing=True)),
]


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
@pytest.mark.parametrize("strategy, world_size, overrides", COMPOSITIONS,
                         ids=["fsdp-tp", "fsdp-tp-sp", "hsdp", "ddp-scratch-tp-sp", "pp-tp", "pp-fsdp", "pp-zbv-tp",
                              "pp-fsdp-tp-3d-checkpointing"])
@cases(lambda strategy, world_size, overrides: _case(strategy, world_size, **overrides))
def test_compositions_match_single_device(strategy, world_size, overrides, request):
    """dp x pp x tp ranks (gradients averaged over dp, summed partial products over tp,
    activations passed between stages) train like one process on the whole batch."""
    result = parity(request)
    assert_parity(result, strategy, world_size)


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_hybrid_sharding_all_reduces_each_shard_across_replicas():
    """HSDP on 4 ranks as 2 replicas x 2 shards: inside a replica FSDP's reduce-scatter of
    the whole gradients, then each rank all-reduces its shard (half of them) with the other
    replica; plain FSDP over 4 ranks has no all-reduce at all."""
    def comm(extra):
        cfg = RunConfig(strategy="fsdp", world_size=4, steps=3, extra=extra, track_memory=False).validate()
        record = launch(cfg, progress=False)
        return record["comm_calls_per_step_by_rank"][0], record["comm_payload_bytes_per_step_by_rank"][0]

    (plain_calls, _), (calls, payload) = comm({}), comm({"replicas": 2})
    assert "all_reduce" not in plain_calls
    assert calls["all_reduce"] == calls["reduce_scatter"]  # one per unit
    assert payload["all_reduce"] * 2 == payload["reduce_scatter"]  # the shard: 1/2 of the gradients


def test_one_reference_serves_every_check_of_the_same_config(monkeypatch):
    """`check` runs one device's reference once per config in a process (it is deterministic):
    a second strategy on the same config reuses it; another seed or model is another reference."""
    import importlib

    check_module = importlib.import_module("multigpu.check")  # the module: multigpu.check is also the function
    started = []

    def fake_launch(cfg, params_path, progress):
        started.append((cfg.strategy, cfg.seed, cfg.model))
        torch.save({"w": torch.full((2,), float(cfg.seed))}, params_path)
        return {"loss": [1.0, 0.5], "grid": cfg.grid.as_dict()}

    monkeypatch.setattr(check_module, "launch", fake_launch)
    monkeypatch.setattr(check_module, "_references", type(check_module._references)())
    for strategy in ("ddp", "zero2"):
        assert check_module.check(strategy, 2, steps=2)["passed"]
    assert [s for s, *_ in started] == ["ddp", "single", "zero2"]
    check_module.check("ddp", 2, steps=2, seed=1)
    check_module.check("ddp", 2, steps=2, model="gpt-mini")
    assert started[3:] == [("ddp", 1, "gpt-tiny"), ("single", 1, "gpt-tiny"), ("ddp", 0, "gpt-mini"),
                           ("single", 0, "gpt-mini")]


@pytest.mark.slow
@pytest.mark.timeout(SERIES_TIMEOUT)
def test_a_series_gives_each_case_its_own_verdict():
    """One torchrun runs a series of parity checks; a run that fails part-way fails its own case
    only: the runs before it keep their verdicts, and the case is checked again on its own, so
    its error is its own (here: its reference, which the same fault stops too)."""
    from multigpu.launch import LaunchError

    results = check_series([("ddp", 2, {}), ("ddp", 2, {"fault": "raise@0:1"})], steps=STEPS)
    assert results[0]["passed"] is True
    assert isinstance(results[1], LaunchError) and "injected fault on rank 0 at step 1" in str(results[1])
