"""The FLOPs the MFU is computed from (multigpu.estimator.flops), held against PyTorch's own count of a
real forward and backward (torch.utils.flop_counter), every product included: attention's too (SDPA's math
kernel, whose products the counter sees), checkpointed blocks run again, k of E experts."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from multigpu.estimator.flops import sample_flops, step_flops
from multigpu.models import (
    apply_activation_checkpointing,
    build_from_config_file,
    build_model,
    compute_loss,
    transformer_blocks,
)


def counted(model: torch.nn.Module, batch: dict) -> int:
    """FLOPs torch counts for one forward and backward of `batch`."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        compute_loss(model, batch).backward()
    return counter.get_total_flops()


def tokens(vocab: int, batch: int, length: int) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-mini"])
@pytest.mark.parametrize("checkpointing", [False, True, "selective"])
def test_a_gpts_flops_are_what_torch_counts(name, checkpointing):
    model = build_model(name)
    ids = tokens(model.cfg.vocab_size, 3, 24)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
    flops = sample_flops(name, 24)
    assert counted(model, {"input_ids": ids, "labels": ids}) == 3 * flops.hardware(checkpointing)
    assert flops.model < flops.hardware(True) < flops.model + flops.forward  # not the head, nor each MLP's output
    # selective: attention's output projection again (the MLP's is the block's last product)
    projections = sum(b.attn.proj.weight.numel() for b in transformer_blocks(model))
    assert flops.hardware("selective") - flops.model == 2 * 24 * projections


@pytest.mark.parametrize("name", ["t5-tiny", "gpt-moe-tiny", "llama"])
@pytest.mark.parametrize("checkpointing", [True, "selective"])
def test_checkpointing_runs_each_block_again_as_torch_does(name, checkpointing, tmp_path):
    from multigpu.hf import write_tiny_llama_config
    from multigpu.moe import even_routing

    if name == "llama":
        name = str(write_tiny_llama_config(tmp_path / "llama.json"))
    model, _ = build_from_config_file(name) if name.endswith(".json") else (build_model(name), None)
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else model.config.vocab_size
    ids = tokens(vocab, 2, 16)
    apply_activation_checkpointing(model, checkpointing)
    with even_routing():
        expected = 2 * sample_flops(name, 16).hardware(checkpointing)
        assert counted(model, {"input_ids": ids, "labels": ids}) == expected


def test_a_llama_with_grouped_keys_counts_its_queries_width(tmp_path):
    from multigpu.hf import write_tiny_llama_config

    path = str(write_tiny_llama_config(tmp_path / "llama.json"))
    model, _ = build_from_config_file(path)
    ids = tokens(model.config.vocab_size, 2, 16)
    assert counted(model, {"input_ids": ids, "labels": ids}) == 2 * sample_flops(path, 16).model


def test_t5s_encoder_and_decoder_see_their_own_lengths():
    model = build_model("t5-tiny")
    source, target = tokens(model.config.vocab_size, 2, 20), tokens(model.config.vocab_size, 2, 12)
    flops = counted(model, {"input_ids": source, "labels": target})
    assert flops == 2 * sample_flops("t5-tiny", 20, 12).model
    assert sample_flops("t5-tiny", 20, 12).model != sample_flops("t5-tiny", 16, 16).model


def test_a_mixture_of_experts_counts_k_of_e_experts():
    from multigpu.moe import even_routing

    model = build_model("gpt-moe-tiny")
    ids = tokens(model.cfg.vocab_size, 2, 32)
    with even_routing():  # every expert gets its share, nothing dropped: the count a balanced layer has
        flops = counted(model, {"input_ids": ids, "labels": ids})
    assert flops == 2 * sample_flops("gpt-moe-tiny", 32).model


def test_a_steps_flops_are_the_global_batchs_whatever_the_split():
    config = {"model": "gpt-tiny", "seq_len": 16, "global_batch_size": 8, "activation_checkpointing": False}
    model, hardware = step_flops(config)
    assert model == hardware == 8 * sample_flops("gpt-tiny", 16).model
    accumulated = step_flops({**config, "grad_accum_steps": 4, "world_size": 2})
    assert accumulated == (model, hardware)  # accumulation and ranks split the same 8 samples


def test_the_matmul_sweep_times_products_of_each_size_until_one_is_too_slow():
    from multigpu.experiments.limits import matmul_rates, memory_rate, thread_counts

    threads = torch.get_num_threads()
    rows = matmul_rates("cpu", "fp32", 1, (32, 64), min_time_s=0.01)
    assert [(r["n"], r["flops"]) for r in rows] == [(32, 2 * 32**3), (64, 2 * 64**3)]
    assert all(r["best_flops_per_s"] >= r["median_flops_per_s"] > 0 and r["calls"] >= 3 for r in rows)
    assert len(matmul_rates("cpu", "bf16", 1, (32, 64), min_time_s=0.01, slowest_call_s=0.0)) == 1
    assert torch.get_num_threads() == threads  # the sweep's threads were set back
    copy = memory_rate("cpu", 1, 2**20)
    assert copy["bytes"] == 2 * 2**20 and copy["best_bytes_per_s"] >= copy["median_bytes_per_s"] > 0
    assert thread_counts(1) == [1] and thread_counts(2) == [1, 2] and thread_counts(12) == [1, 2, 4, 8, 12]


def matmul(dtype: str, threads: int | None, *rates: float) -> list[dict]:
    return [{"kind": "matmul", "dtype": dtype, "threads": threads, "n": 256 * (i + 1), "best_flops_per_s": rate}
            for i, rate in enumerate(rates)]


def test_the_peak_is_the_best_size_at_the_runs_threads():
    from multigpu.estimator.flops import peak_flops_per_s

    limits = matmul("fp32", 1, 4e9, 5e9) + matmul("fp32", 2, 9e9) + matmul("fp32", 4, 16e9) + matmul("bf16", 1, 7e9)
    assert peak_flops_per_s(limits, "fp32", 1) == 5e9  # the best size's
    assert peak_flops_per_s(limits, "fp32", 3) == 12.5e9  # between 2 and 4 threads
    assert peak_flops_per_s(limits, "fp32", 8) == 16e9  # threads beyond the cores share them
    assert peak_flops_per_s(limits, "bf16", 1) == 7e9 and peak_flops_per_s(limits, "fp16", 1) is None
    assert peak_flops_per_s(matmul("bf16", None, 1e14, 3e14), "bf16") == 3e14  # a GPU's


def record(world_size: int, device_type: str, step_time_s: float, backend: str = "gloo", **config) -> dict:
    return {"config": {"model": "gpt-tiny", "seq_len": 16, "global_batch_size": 8, "dtype": "fp32",
                       "activation_checkpointing": False, "world_size": world_size, **config},
            "seq_len": 16, "step_time_s": step_time_s,
            "provenance": {"device_type": device_type, "backend": backend, "cpu_count": 4, "threads_per_worker": 1,
                           "machine_tag": "nowhere"}}


def test_mfu_is_the_global_batchs_model_flops_over_every_devices_peak():
    from multigpu.estimator.flops import utilization

    model = 8 * sample_flops("gpt-tiny", 16).model
    cpu = matmul("fp32", 1, 5e9) + matmul("fp32", 2, 9e9) + matmul("fp32", 4, 16e9)
    # 2 processes of 1 thread on 4 cores: the peak of 2 threads; a step at that rate is an MFU of 1
    assert utilization(record(2, "cpu", model / 9e9), cpu)["mfu"] == pytest.approx(1.0)
    # accumulation does not change what a step computes; DataParallel's replicas are threads that run at once
    assert utilization(record(2, "cpu", model / 9e9, grad_accum_steps=4), cpu)["mfu"] == pytest.approx(1.0)
    assert utilization(record(2, "cpu", model / 9e9, backend="threads"), cpu)["devices"] == 2  # replicas' threads
    gpu = matmul("bf16", None, 4e14)
    found = utilization(record(4, "cuda", model / 4e14, backend="nccl", dtype="bf16-mixed"), gpu)
    assert found["mfu"] == pytest.approx(0.25) and found["peak_flops_per_s"] == 16e14  # four GPUs' peak
    checkpointed = utilization(record(4, "cuda", 1.0, backend="nccl", dtype="bf16-mixed",
                                      activation_checkpointing=True), gpu)
    assert checkpointed["hfu"] > checkpointed["mfu"]  # the recomputation counts as hardware FLOPs only
    assert utilization(record(4, "cuda", 1.0, backend="nccl"), gpu) is None  # no fp32 peak measured
    assert utilization(record(4, "cuda", None, backend="nccl"), gpu) is None  # no step timed


def test_a_mixture_of_experts_is_not_counted_the_assignments_its_capacity_dropped():
    from multigpu.estimator.flops import utilization

    flops = sample_flops("gpt-moe-tiny", 16)
    assert 0 < flops.routed < flops.weights
    run = record(1, "cpu", 1.0, model="gpt-moe-tiny")
    limits = matmul("fp32", 1, 1e9)
    whole = utilization(run, limits)["model_flops_per_step"]
    assert whole == 8 * flops.model
    run["moe"] = {"tokens_per_expert": [[[30, 34], [32, 32]]], "dropped": [[16, 48]]}  # a quarter, then three
    assert utilization(run, limits)["model_flops_per_step"] == pytest.approx(whole - 3 * flops.routed * 8 * 0.5)


def test_the_step_time_model_is_held_against_the_runs_it_models():
    from multigpu import records
    from multigpu.estimator.accuracy import step_time_rows

    tag = "cpu-2core-gloo"
    runs = records.load("tp_scaling", tag)
    rows = step_time_rows(runs, tag)
    assert rows and all(r["nothing_hidden_s"] >= r["all_hidden_s"] > 0 for r in rows)
    assert all(r["error"] == pytest.approx(r["nothing_hidden_s"] / r["measured_s"] - 1) for r in rows)
    one_thread = [r for r in runs if r["provenance"]["threads_per_worker"] == 1 and r["config"]["strategy"] != "dp"]
    assert len(rows) <= len(one_thread)  # a process on several threads is not held to the one-thread rate
    assert step_time_rows([{**runs[0], "provenance": {**runs[0]["provenance"], "threads_per_worker": 2}}], tag) == []
