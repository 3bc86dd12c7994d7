"""The estimator (multigpu.estimator) against references: parameter counts of the built
models, and activations traced on fake tensors against activations measured on real ones."""

import json
import re
from dataclasses import replace

import pytest
import torch

from multigpu.config import OPTIMIZERS, ConfigError, RunConfig, parse_bytes
from multigpu.estimator.accuracy import TOTAL_TOLERANCE, setup_of
from multigpu.estimator.model_trace import activation_cost, model_shape
from multigpu.memory import PeakMemoryTracker
from multigpu.models import (
    GPT_SIZES,
    apply_activation_checkpointing,
    build_model,
    compute_loss,
    count_parameters,
    t5_config,
    vocab_size,
)
from multigpu.strategies import build_optimizer

pytestmark = pytest.mark.usefixtures("committed_records")  # the committed records only (conftest)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small", "gpt2", "t5-tiny", "t5-small", "t5-large"])
def test_parameter_count_is_the_built_models(name):
    with torch.device("meta"):
        assert model_shape(name).parameters == count_parameters(build_model(name))


def test_hugging_face_config_files_give_the_presets_counts(tmp_path):
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps({**t5_config("t5-small").to_dict(), "model_type": "t5"}))
    assert model_shape(str(t5)).parameters == model_shape("t5-small").parameters
    cfg = GPT_SIZES["gpt2"]
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer,
                                "n_head": cfg.n_head, "n_embd": cfg.d_model, "n_positions": cfg.seq_len}))
    assert model_shape(str(gpt2)).parameters == 124_439_808  # GPT-2 small as released


def _measured_saved(name, batch, seq, target=None, dtype="fp32", checkpointing=False):
    model = build_model(name)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size(name), (batch, seq), generator=g)
    labels = torch.randint(vocab_size(name), (batch, target or seq), generator=g)
    with PeakMemoryTracker(model) as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16-mixed"):
            compute_loss(model, {"input_ids": ids, "labels": labels}).backward()
    return tracker.saved_activation_bytes


@pytest.mark.parametrize("name, seq, target, dtype, checkpointing", [
    ("gpt-small", 128, None, "fp32", False),
    ("gpt-small", 64, None, "bf16-mixed", False),
    ("gpt-small", 128, None, "fp32", True),
    ("gpt-small", 128, None, "fp32", "selective"),
    ("gpt-small", 64, None, "bf16-mixed", "selective"),
    ("t5-tiny", 32, 16, "fp32", False),
    ("t5-tiny", 32, 32, "fp32", True),
    ("t5-tiny", 32, 16, "fp32", "selective"),
])
def test_traced_activations_equal_measured(name, seq, target, dtype, checkpointing):
    cost = activation_cost(name, seq, target, autocast=dtype == "bf16-mixed", checkpointing=checkpointing)
    for batch in (3, 5):  # neither of the traced batch sizes
        assert cost.saved(batch) == _measured_saved(name, batch, seq, target, dtype, checkpointing)


@pytest.mark.parametrize("name, seq", [("gpt2", 64), ("t5-tiny", 32)])
def test_a_fully_recomputed_block_keeps_nothing_of_cudas_attention(name, seq):
    """CUDA's fused attention keeps its output, one log-sum-exp per row and (given a float mask) the mask's
    copies, but only while the output lives: a fully recomputed block frees all of it when its forward ends,
    so what full recomputation keeps is the same on both devices. Measured on an H200 (results/1xH200-nccl,
    recomputation: gpt2 at 1024 tokens, batch 8, kept 1906.6 MiB), where counting every call's keeps had
    over-estimated by 292.6 MiB, about one block's output per block."""
    cpu, cuda = (activation_cost(name, seq, checkpointing=True, device=d) for d in ("cpu", "cuda"))
    assert (cuda.per_sample, cuda.last_block, cuda.fixed) == (cpu.per_sample, cpu.last_block, cpu.fixed)
    kept = activation_cost(name, seq, device="cuda")  # without recomputation the keeps still count
    assert kept.per_sample > cuda.per_sample


def _t5_with_dropout(tmp_path) -> str:
    """t5-tiny's sizes with the released models' dropout, as a config.json."""
    path = tmp_path / "t5-tiny-dropout.json"
    path.write_text(json.dumps({**t5_config("t5-tiny").to_dict(), "model_type": "t5", "dropout_rate": 0.1}))
    return str(path)


def _saved_by_forward(name, batch, seq, attention, native_dropout=False) -> int:
    """Bytes a real forward keeps (what the trace counts, counted on real tensors); with
    `native_dropout`, every dropout runs ATen's native_dropout, the kernel CUDA runs (its mask:
    a bool per element), here on the CPU."""
    from unittest import mock

    from multigpu.estimator.model_trace import _AliveStorages

    model = build_model(name)
    model.set_attn_implementation(attention)
    ids = torch.randint(vocab_size(name), (batch, seq), generator=torch.Generator().manual_seed(0))
    native = lambda x, p=0.5, training=True, inplace=False: (  # noqa: E731
        torch.native_dropout(x, p, training)[0] if training and p > 0 else x)
    skip = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    with mock.patch("torch.nn.functional.dropout", native) if native_dropout else mock.MagicMock():
        with _AliveStorages(skip) as alive:
            out = model(input_ids=ids, labels=ids)
            saved = alive.alive_bytes("cpu")
    del out
    return saved


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_released_dropout_is_traced_as_this_cpu_keeps_it(tmp_path, attention):
    name = _t5_with_dropout(tmp_path)
    cost = activation_cost(name, 32, attention=attention)
    assert cost.saved(3) == _saved_by_forward(name, 3, 32, attention)
    assert cost.per_sample > activation_cost(name, 32, attention=attention, dropout=False).per_sample


def test_cuda_dropout_masks_are_a_byte_per_element(tmp_path):
    # the reference: the same forward with every dropout run by native_dropout, CUDA's kernel
    name = _t5_with_dropout(tmp_path)
    cuda = activation_cost(name, 32, attention="eager", device="cuda")
    for batch in (3, 4):
        assert cuda.saved(batch) == _saved_by_forward(name, batch, 32, "eager", native_dropout=True)
    assert cuda.per_sample < activation_cost(name, 32, attention="eager").per_sample


def test_fused_attention_on_cuda_keeps_no_probabilities_but_a_float_mask_twice(tmp_path):
    """CUDA's fused kernels keep the output and a log-sum-exp per row, no S x S probabilities; given
    a floating-point mask (T5's position bias) they also keep two batch-wide copies of it, as T5's
    runs on an H200 measured (model_trace.MASK_COPIES_ON_CUDA)."""
    from multigpu.estimator.model_trace import MASK_COPIES_ON_CUDA

    name = _t5_with_dropout(tmp_path)
    eager, fused = (activation_cost(name, 32, attention=a, dropout=False, device="cuda") for a in ("eager", "sdpa"))
    heads, calls = t5_config("t5-tiny").num_heads, 3 * t5_config("t5-tiny").num_layers  # self, self, cross
    matrix = calls * heads * 32 * 32 * 4  # one fp32 S x S matrix per head and call, per sample
    rows = calls * heads * 32 * 4  # the fused kernel's log-sum-exp, per sample
    masks = MASK_COPIES_ON_CUDA * matrix  # the position bias, batch-wide, twice per call
    assert masks <= fused.per_sample <= eager.per_sample - matrix + rows + masks + calls * heads * 32 * 16 * 4
    # the package's GPT runs the fused kernel on the CPU too: both devices count the same
    assert activation_cost("gpt-small", 64) == activation_cost("gpt-small", 64, device="cuda")


def test_attention_and_device_are_checked():
    with pytest.raises(ConfigError, match="scaled_dot_product_attention only"):
        activation_cost("gpt-small", 64, attention="eager")
    with pytest.raises(ConfigError, match="attention must be one of"):
        activation_cost("t5-tiny", 32, attention="flash")
    with pytest.raises(ConfigError, match="device must be one of"):
        activation_cost("t5-tiny", 32, device="tpu")


@pytest.mark.parametrize("model, says", [
    ("params:abc", "positive number"),
    ("params:0", "positive number"),
    ("no-such-model", "neither a preset"),
])
def test_bad_models_are_named(model, says):
    with pytest.raises(ConfigError, match=says):
        model_shape(model)


def test_unsupported_config_and_count_only_activations_are_explained(tmp_path):
    vit = tmp_path / "vit.json"  # an image model: not a decoder the package can build, so nothing to estimate
    vit.write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ConfigError, match="not a causal language model"):
        model_shape(str(vit))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        model_shape(str(broken))
    gpt2 = {"model_type": "gpt2", "vocab_size": 100, "n_layer": 2, "n_head": 3, "n_embd": 64}
    for content, says in [([1, 2], "JSON list"),
                          ({**gpt2, "n_layer": None}, "positive whole number"),
                          ({k: v for k, v in gpt2.items() if k != "n_layer"}, "needs the setting 'n_layer'"),
                          (gpt2, "split evenly over the 3 attention heads"),
                          ({"model_type": "t5", "d_model": "wide"}, "the setting 'd_model' is 'wide'")]:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(content))
        model_shape.cache_clear()
        with pytest.raises(ConfigError, match=says):
            model_shape(str(bad))
    with pytest.raises(ConfigError, match="no activations"):
        activation_cost("params:7.5e9", 256)


# -- the estimate of a step's peak ---------------------------------------------------------------

from multigpu.estimator.peak import estimate, model_states, predict_largest_batch  # noqa: E402
from multigpu.estimator.question import Setup  # noqa: E402
from multigpu.estimator.share import rank_shares  # noqa: E402
from series import RunCache  # noqa: E402
from test_cli import in_process, only_json_line, run_cli  # noqa: E402
from test_measurements import ZERO_TABLE_1  # noqa: E402


@pytest.mark.parametrize("stage, strategy", [(0, "ddp"), (1, "zero1"), (2, "zero2"), (3, "zero3")])
def test_model_states_reproduce_the_zero_papers_table_1(stage, strategy):
    for n, printed in zip([1, 4, 16, 64, 256, 1024], ZERO_TABLE_1[stage]):
        setup = Setup("params:7.5e9", strategy, n, dtype="bf16-master", optimizer="adamw")
        total_gb = estimate(setup).per_rank_bytes["total"] / 1e9
        scale = 10 ** len(str(printed).partition(".")[2])  # the paper's printed precision
        assert int(total_gb * scale + 0.5) / scale == printed, (stage, n, total_gb)


def test_largest_batch_is_the_last_that_fits():
    setup = Setup("gpt-small", "ddp", 2, seq_len=128)
    found = predict_largest_batch(setup, 256 * 2**20)
    assert found.per_rank_bytes["total"] <= 256 * 2**20
    assert estimate(setup, found.global_batch + 2).per_rank_bytes["total"] > 256 * 2**20
    assert predict_largest_batch(setup, 2**20) is None  # not even the model fits


@pytest.mark.parametrize("text, nbytes", [("32GiB", 32 * 2**30), ("80GB", 80 * 10**9), ("512 mib", 512 * 2**20),
                                          ("1.5e3MB", 1.5e9)])
def test_memory_amounts_are_read_with_their_units(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["lots", "32GiBs", "-1GiB", "0GB"])
def test_bad_memory_amounts_are_named(text):
    with pytest.raises(ConfigError, match="memory"):
        parse_bytes(text)


def test_a_bare_number_is_bytes_and_zero_only_where_allowed():
    assert parse_bytes("32") == 32
    assert parse_bytes("0MiB", allow_zero=True) == 0


def test_a_named_gpu_is_its_memory_less_the_cuda_context():
    """A named GPU: its memory, less the CUDA context (500 MiB unless --cuda-context says),
    cuBLAS's workspaces and the allocator's rounding; a bare --gpu-memory is all usable."""
    from multigpu.estimator.question import allocator_rounding_bytes, cublas_workspace_bytes

    def other(*args, batch=("--batch-size", "8")):  # in this process: test_estimate_cli_answers_in_json runs one
        result = in_process("estimate", "--model", "gpt-small", "--seq-len", "128", *batch, "--json", *args)
        assert result.returncode == 0, result.stderr
        out = only_json_line(result.stdout)
        return out.get("max_batch_size"), out["per_rank_bytes"]["other"]

    gpu_extra = cublas_workspace_bytes("v100-16gb") + allocator_rounding_bytes(Setup("gpt-small", on_cuda=True))
    _, named = other("--gpu", "v100-16gb")
    assert named - other("--gpu-memory", "16GiB", "--cuda-context", "500MiB")[1] == gpu_extra
    assert named - other("--gpu", "v100-16gb", "--cuda-context", "0")[1] == 500 * 2**20
    # the tensors alone: a bare --gpu-memory is asked as this CPU, whose own peak is calibrated
    assert other("--gpu", "v100-16gb", batch=["--max-batch", "--uncalibrated"])[0] < other(
        "--gpu-memory", "16GiB", batch=["--max-batch", "--uncalibrated"])[0]


def test_estimate_cli_answers_in_json():
    # the tensors alone (--uncalibrated): a CPU process's own peak adds a few hundred MiB beside
    result = run_cli("estimate", "--model", "gpt-small", "--strategy", "fsdp", "--world-size", "4",
                     "--seq-len", "128", "--gpu-memory", "256MiB", "--max-batch", "--json", "--uncalibrated")
    assert result.returncode == 0, result.stderr
    out = only_json_line(result.stdout)
    assert out["machine_bytes"] is None and out["calibration"] is None
    assert set(out["per_rank_bytes"]) == {"params", "grads", "optimizer", "activations", "other", "total"}
    assert out["per_rank_bytes"]["total"] == sum(v for k, v in out["per_rank_bytes"].items() if k != "total")
    assert out["fits"] is True and out["max_batch_size"] == out["batch_size"] > 0
    assert out["batch_size"] % 4 == 0 and out["per_rank_batch"] == out["batch_size"] // 4


@pytest.mark.parametrize("args, says", [
    (["--model", "gpt-small", "--strategy", "pp-zbv"], "strategies"),
    (["--model", "gpt-small", "--world-size", "2", "--batch-size", "3"], "multiple"),
    (["--model", "gpt-small", "--max-batch"], "--gpu-memory"),
    (["--model", "gpt-small", "--gpu", "a100-81gb", "--max-batch"], "unknown --gpu"),
    (["--model", "params:1e9", "--batch-size", "8"], "no activations"),
    (["--model", "gpt-small", "--strategy", "single", "--world-size", "4"], "one device"),
    (["--model", "gpt-tiny", "--batch-size", "2"], "--seq-len 64 or less"),  # the default 256 tokens
])
def test_estimate_cli_explains_bad_input(args, says):
    result = in_process("estimate", *args)
    code, err = result.returncode, result.stderr
    assert code == 2 and says in err and err.startswith("error: ") and len(err.splitlines()) == 1, (code, err)
    assert result.stdout == ""


def _recorded_runs():
    from multigpu.records import RESULTS_DIR

    return [record for path in sorted(RESULTS_DIR.glob("*/*.jsonl")) for line in path.read_text().splitlines()
            if line.strip() and "config" in (record := json.loads(line))]


def test_estimated_peak_agrees_with_every_recorded_run():
    from multigpu.estimator.accuracy import against_records

    rows = against_records(_recorded_runs())
    assert {r["strategy"] for r in rows} >= {"single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp"}
    worst = max(rows, key=lambda r: abs(r["total_error"]))
    assert abs(worst["total_error"]) <= TOTAL_TOLERANCE, worst


# The estimator's peak moments were found by comparing with the recorded runs, so they are
# also checked on runs it was not fitted to: another model (T5), other optimizers, sequence
# lengths, batches and dtypes, measured fresh. Totals only: at a peak at the end of
# backward, the tracker files some of T5's tensors made during forward as activations (DDP's
# buckets, rebuilt in the second step's forward; the chapter says so).
HELD_OUT = [
    dict(model="t5-small", strategy="ddp", world_size=2, seq_len=64, global_batch_size=4, optimizer="sgd-momentum"),
    dict(model="t5-small", strategy="zero3", world_size=2, seq_len=64, global_batch_size=4, optimizer="adamw"),
    dict(model="t5-small", strategy="fsdp", world_size=4, seq_len=32, global_batch_size=8, optimizer="sgd"),
    dict(model="gpt-small", strategy="zero2", world_size=4, seq_len=64, global_batch_size=16, optimizer="adam"),
    dict(model="gpt-small", strategy="ddp", world_size=2, seq_len=128, global_batch_size=4, optimizer="adamw",
         dtype="bf16-mixed"),
    # context parallelism: each rank's activations are its part of the sequence's (ring attention, zig-zag)
    dict(model="gpt-long", strategy="cp-scratch", world_size=2, seq_len=2048, global_batch_size=2, optimizer="adamw"),
    dict(model="gpt-long", strategy="fsdp", world_size=4, cp=2, seq_len=1024, global_batch_size=4, optimizer="sgd"),
    # a mixture of experts: a rank keeps 1/ep of the experts; its activations are a balanced layer's
    dict(model="gpt-moe-small", strategy="ep-scratch", world_size=2, seq_len=64, global_batch_size=4,
         optimizer="adamw"),
    dict(model="gpt-moe-small", strategy="ep-scratch", world_size=4, ep=2, seq_len=64, global_batch_size=8,
         optimizer="sgd-momentum"),
    dict(model="gpt-moe-small", strategy="fsdp", world_size=4, ep=2, seq_len=64, global_batch_size=8,
         optimizer="adamw"),
    # selective recomputation under tensor and sequence parallelism: the collectives' results kept
    dict(model="gpt-small", strategy="tp", world_size=2, seq_len=128, global_batch_size=4, optimizer="adamw",
         activation_checkpointing="selective", extra={"sequence_parallel": True}),
]


# the held-out runs as series, one per process count (tests/series.py): peaks by the tracker, per run
_held_out = RunCache(lambda: [RunConfig(steps=3, dataset="dummy", **changes) for changes in HELD_OUT])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("changes", HELD_OUT, ids=lambda c: f"{c['model']}-{c['strategy']}-{c['world_size']}"
                                                           + (f"-cp{c['cp']}" if "cp" in c else "")
                                                           + (f"-ep{c['ep']}" if "ep" in c else "")
                                                           + ("-sac" if c.get("activation_checkpointing") else ""))
def test_estimated_peak_agrees_with_fresh_runs_it_was_not_fitted_to(changes):
    from multigpu.estimator.accuracy import against_records

    record = _held_out(RunConfig(steps=3, dataset="dummy", **changes))
    [row] = against_records([record])
    assert abs(row["total_error"]) <= TOTAL_TOLERANCE, (row["estimated"], row["measured"], row["phase"])


def test_estimated_categories_agree_with_the_recorded_runs():
    """Each category within 10% of itself or 5% of the peak (a few MiB move between categories
    with the allocator's timing)."""
    from multigpu.estimator.accuracy import against_records, categories_off

    rows = against_records(_recorded_runs())
    assert len(rows) >= 40
    # A known gap, kept in sight: with full recomputation under sequence parallelism (experiment recomputation)
    # the measured peak holds fewer gradients and more "other" than the estimator's backward moment, so it comes
    # at a moment of backward the estimator's phases do not model. Its totals are held, and its other categories
    # must agree
    gap = [r for r in rows if r["strategy"] == "tp" and "SP" in r["variant"] and "full recompute" in r["variant"]]
    assert gap and all(abs(r["total_error"]) <= TOTAL_TOLERANCE for r in gap)
    for row in rows:
        off = categories_off(row)
        if row in gap:
            off = [c for c in off if c not in ("other", "grads")]
        assert not off, (row["strategy"], row["world_size"], row["variant"], row["estimated"], row["measured"])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_state_is_what_torchs_optimizer_keeps(optimizer):
    """Against PyTorch's own optimizer after a step: its state tensors, less Adam's scalar
    step counters (4 bytes per parameter tensor, which the estimate leaves out)."""
    model = build_model("gpt-tiny")
    opt = build_optimizer(model.parameters(), RunConfig(optimizer=optimizer))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    kept = sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    assert estimate(Setup("gpt-tiny", seq_len=64, optimizer=optimizer), 1).per_rank_bytes["optimizer"] == kept


def test_offloading_the_optimizer_state_takes_it_off_the_device():
    on = estimate(Setup("gpt-small", "zero2", 2, seq_len=128, offload_optimizer=True), 4).per_rank_bytes
    off = estimate(Setup("gpt-small", "zero2", 2, seq_len=128), 4).per_rank_bytes
    assert on["optimizer"] == 0 and off["optimizer"] > 0
    assert off["total"] - on["total"] == off["optimizer"]
    with pytest.raises(ConfigError, match="ZeRO stage"):
        estimate(Setup("gpt-small", "ddp", 2, offload_optimizer=True), 4)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs: the estimate against the CUDA allocator's peak")
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_estimate_agrees_with_the_cuda_allocator(strategy):
    from multigpu import RunConfig
    from multigpu.launch import launch

    record = launch(RunConfig(strategy=strategy, world_size=2, model="gpt-small", seq_len=128,
                              global_batch_size=8, steps=3, optimizer="adamw", device="cuda"), progress=False)
    estimated = estimate(setup_of(record), 8).per_rank_bytes["total"]
    measured = record["cuda_allocator_peak_bytes_by_rank"][0]
    assert abs(estimated / measured - 1) <= 0.10, (estimated, measured)


# -- tensor and pipeline parallelism ---------------------------------------------------------------
# Against the committed records of the tensor- and pipeline-parallel chapters (measured on this
# machine's CPU processes), and against Korthikanti et al. 2022's count of a block's activations.


def _runs_of(*experiments):
    from multigpu import records

    return [(r, setup_of(r)) for name in experiments for r in records.load(name)
            if "config" in r and not r["config"]["extra"].get("repeat") and setup_of(r) is not None]


def test_model_states_per_rank_are_the_recorded_ones_under_tp_and_pp():
    """Every pipeline rank's parameters (its stages' blocks, the embeddings on the first, the
    final norm and a copy of the tied head on the last), cut by tp, byte for byte. The
    from-scratch TP keeps the position table whole under sequence parallelism, the library
    (which the estimate follows) cuts it."""
    checked = 0
    for record, setup in _runs_of("tp_scaling", "pp_memory", "pp_schedules"):
        if record["config"]["strategy"] == "tp-scratch" and setup.sequence_parallel:
            continue
        for share in rank_shares(setup):
            rank = share.pipeline_rank or 0
            assert model_states(setup, share)["params"] == record["model_state_bytes_by_rank"][rank]["params"]
            checked += 1
    assert checked >= 20


def test_model_states_per_rank_are_the_recorded_ones_in_the_compositions():
    """FSDP x TP, PP x TP, PP x FSDP and 3D: each rank's parameters, gradients and optimizer
    state between steps (its stage's share, cut by tp, sharded over dp), byte for byte."""
    from multigpu.runtime import RankGrid

    runs = [(r, s) for r, s in _runs_of("compositions") if s.tp > 1 or s.pp > 1]
    assert {r["composition"] for r, _ in runs} >= {"FSDP x TP (2D)", "PP x TP", "PP x FSDP", "PP x FSDP x TP (3D)"}
    for record, setup in runs:
        d = setup.grid.as_dict()
        shares = {share.pipeline_rank or 0: share for share in rank_shares(setup)}
        for rank, measured in enumerate(record["model_state_bytes_by_rank"]):
            stage = RankGrid({"pp": d["pp"], "dp": d["dp"], "tp": d["tp"]}, rank).coord("pp")
            estimated = model_states(setup, shares[stage])
            assert all(estimated[k] == measured[k] for k in measured), (record["composition"], rank)


def test_saved_activations_per_micro_batch_are_the_recorded_ones_under_tp_and_pp():
    """One micro-batch's saved activations per rank, within 2% (a later pipeline stage also
    keeps the hidden states it received, which the tracker does not see)."""
    checked = 0
    for record, setup in _runs_of("tp_scaling", "pp_memory", "pp_schedules"):
        b = record["config"]["global_batch_size"] // (setup.grid.dp * setup.grad_accum_steps)
        for share in rank_shares(setup):
            measured = record["saved_activation_bytes_by_rank"][share.pipeline_rank or 0]
            if measured is None:  # the library's pipelines are not tracked
                continue
            assert abs(share.activations.saved(b) / measured - 1) <= 0.02, (record["config"], share.pipeline_rank)
            checked += 1
    assert checked >= 20


def test_the_recorded_runs_include_tensor_and_pipeline_parallelism():
    from multigpu.estimator.accuracy import against_records

    rows = against_records(_recorded_runs())
    assert {"tp", "tp-scratch", "pp-gpipe-scratch", "pp-1f1b-scratch"} <= {r["strategy"] for r in rows}
    assert {r["rank"] for r in rows if r["strategy"] == "pp-gpipe-scratch"} == {1}  # the head's stage is the peak


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_a_blocks_activations_follow_korthikanti_without_dropout(t):
    """Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198, section 4.1) count a block's
    activations in 16 bits as s*b*h*(10 + 24/t + 5as/(ht)) bytes; without the dropout masks
    (2 of the 10) and the attention scores (the 5as/(ht)), which this block does not keep,
    that is s*b*h*(8 + 24/t). Traced with bf16 weights, within 1% (the rest: the
    LayerNorms' statistics and attention's log-sum-exp, in fp32)."""
    setup = Setup("gpt-small", "tp" if t > 1 else "single", t, seq_len=128, dtype="bf16-master")
    per_token_and_width = rank_shares(setup)[0].activations.last_block[1] / (128 * 256)
    assert abs(per_token_and_width / (8 + 24 / t) - 1) <= 0.01


@pytest.mark.parametrize("strategy, m, expected", [
    ("pp-gpipe", 4, [4, 4, 4, 4]),  # every forward before any backward
    ("pp-1f1b", 8, [4, 3, 2, 1]),  # min(p - rank, m)
    ("pp-interleaved", 8, [5.5, 4.5, 3.5, 2.5]),  # p(1 + (p-1)/(pv)) on the first rank, v = 2
])
def test_micro_batches_in_flight_follow_the_schedule(strategy, m, expected):
    setup = Setup("gpt2-medium", strategy, 4, seq_len=64, grad_accum_steps=m)  # 24 blocks: 4 or 8 stages
    shares = rank_shares(setup)
    assert [s.in_flight for s in shares] == expected
    found = estimate(setup, 4 * m)
    rank = shares[found.pipeline_rank]
    if found.phase == "forward":  # the peak holds every micro-batch in flight
        assert found.per_rank_bytes["activations"] == int(rank.in_flight * rank.activations.saved(1))


# the grid's own refusals are the package's one rule's (multigpu.grid.resolve_grid); the rest the estimator's
@pytest.mark.parametrize("changes, says", [
    (dict(strategy="tp", world_size=3), "tp 3 does not divide the 8 attention heads; use a tp that divides 8"),
    (dict(strategy="ddp", world_size=4, tp=2), "does not combine with tp (tp=2)"),
    (dict(strategy="fsdp", world_size=4, pp=2), "For pipeline parallelism: a --strategy pp-"),
    (dict(strategy="tp", world_size=4, tp=2), "world size 4 != dp 1 x pp 1 x tp 2 = 2"),
    (dict(strategy="pp-1f1b", world_size=2, grad_accum_steps=1), "needs at least as many micro-batches"),
    (dict(strategy="pp-1f1b", world_size=8, grad_accum_steps=8), "but it has 6 blocks"),
    (dict(strategy="pp-1f1b", world_size=6, pp=4, grad_accum_steps=4), "world size 6 != dp 1 x pp 4 x tp 1 = 4"),
    (dict(strategy="pp-gpipe", world_size=4, tp=2, sequence_parallel=True), "sequence parallelism"),
    (dict(model="t5-small", strategy="tp", world_size=2), "package's GPT"),
])
def test_bad_grids_are_explained(changes, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        estimate(replace(Setup("gpt-small", seq_len=128), **changes), 8)


def test_on_a_gpu_the_estimate_adds_the_context_the_cublas_workspaces_and_the_rounding():
    """What a GPU holds besides the step's tensors, each from its source: the CUDA context
    (given), two cuBLAS workspaces (32 MiB each on Hopper, 8.125 MiB before) and at most
    511 bytes per tensor copy from the allocator's 512-byte blocks."""
    from dataclasses import replace

    from multigpu.estimator.question import allocator_rounding_bytes, cublas_workspace_bytes

    assert cublas_workspace_bytes("NVIDIA H100 80GB HBM3") == 64 * 2**20
    assert cublas_workspace_bytes("NVIDIA A100-SXM4-80GB") == 2 * (8 * 2**20 + 128 * 2**10)
    assert cublas_workspace_bytes(None) == 0
    cpu = Setup("gpt-small", "ddp", 2, seq_len=128, optimizer="adamw")
    gpu = replace(cpu, cuda_context_bytes=500 * 2**20, cuda_workspace_bytes=cublas_workspace_bytes("H100"),
                  on_cuda=True)
    assert allocator_rounding_bytes(gpu) == model_shape("gpt-small").tensors * 4 * 511  # param, grad, 2 moments
    assert allocator_rounding_bytes(cpu) == 0
    a, b = estimate(cpu, 8).per_rank_bytes, estimate(gpu, 8).per_rank_bytes
    assert b["other"] - a["other"] == 500 * 2**20 + 64 * 2**20 + allocator_rounding_bytes(gpu)
    assert {k: v for k, v in a.items() if k not in ("other", "total")} == \
        {k: v for k, v in b.items() if k not in ("other", "total")}


# -- the optimizer's step on a GPU -------------------------------------------------------------


def _adamw_step_temporary(foreach: bool) -> int:
    """Bytes torch's AdamW step holds beside parameters, gradients and both moments (measured)."""
    from multigpu.memory import model_state_bytes

    model = build_model("gpt-tiny", seed=0)
    ids = torch.randint(vocab_size("gpt-tiny"), (2, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    for _ in range(2):  # the first step makes the moments; the second is measured
        optimizer.zero_grad()
        compute_loss(model, {"input_ids": ids, "labels": ids}).backward()
        if optimizer.state:
            with PeakMemoryTracker(model, optimizer) as tracker:
                optimizer.step()
        else:
            optimizer.step()
    held = model_state_bytes(model, optimizer)
    return tracker.by_category["total"] - sum(held[k] for k in ("params", "grads", "optimizer"))


def test_the_optimizer_steps_temporary_is_what_torchs_adamw_allocates():
    """On a GPU, torch's AdamW runs its foreach implementation: measured here on the CPU with
    foreach=True (what CUDA tensors get by default), its step holds one more fp32 tensor per
    parameter beside parameters, gradients and both moments; the estimator's step phase says
    the same. The CPU's default, a loop over tensors (foreach=False), holds two of the largest
    tensor's size."""
    from multigpu.estimator.peak import optimizer_step_temporary
    from multigpu.estimator.question import allocator_rounding_bytes

    model = build_model("gpt-tiny", seed=0)
    on_gpu = Setup("gpt-tiny", "single", seq_len=16, on_cuda=True)
    predicted = optimizer_step_temporary(on_gpu, rank_shares(on_gpu)[0])
    assert predicted == 4 * sum(p.numel() for p in model.parameters())
    assert _adamw_step_temporary(foreach=True) == pytest.approx(predicted, rel=0.01)
    on_cpu = replace(on_gpu, on_cuda=False)
    predicted = optimizer_step_temporary(on_cpu, rank_shares(on_cpu)[0])
    assert predicted == 2 * 4 * max(p.numel() for p in model.parameters())
    assert _adamw_step_temporary(foreach=False) == pytest.approx(predicted, rel=0.01)

    # DDP on 8 GPUs, one short sample each: the step is the peak, with both moments and the
    # temporary (3 x 4 bytes per parameter) and the reducer's buckets (4)
    setup = Setup("gpt2", "ddp", 8, seq_len=64, on_cuda=True)
    found, psi = estimate(setup, 8), 4 * model_shape("gpt2").parameters
    assert found.phase == "optimizer step"
    assert found.per_rank_bytes["optimizer"] == 3 * psi
    assert found.per_rank_bytes["other"] - allocator_rounding_bytes(setup) == psi
    # ZeRO-1: the moments and the temporary are shards
    sharded = estimate(replace(setup, strategy="zero1"), 8)
    assert sharded.per_rank_bytes["optimizer"] <= 3 * psi / 8 + 8


def test_a_trace_kept_on_disk_is_the_trace(tmp_path, monkeypatch):
    """MULTIGPU_TRACE_CACHE keeps a trace for the next process: read back, it equals a fresh one,
    and another argument is another trace."""
    from multigpu.estimator import model_trace

    monkeypatch.setenv("MULTIGPU_TRACE_CACHE", str(tmp_path))
    args = ("gpt-tiny", 32, None, "fp32", False, False, True, "sdpa")
    fresh = model_trace._traced_costs(*args)
    assert model_trace._activation_costs.__wrapped__(*args) == fresh  # traced, then written
    assert len(list(tmp_path.glob("*.pickle"))) == 1
    assert model_trace._activation_costs.__wrapped__(*args) == fresh  # read back
    model_trace._activation_costs.__wrapped__("gpt-tiny", 16, *args[2:])
    assert len(list(tmp_path.glob("*.pickle"))) == 2
