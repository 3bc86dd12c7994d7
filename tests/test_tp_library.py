"""Tensor parallelism with torch.distributed.tensor.parallel (multigpu.strategies.tp).

Parity: one forward, backward and SGD step of the tensor-parallel model on N processes
equals the same step of the single-device model, for the loss, every gradient (gathered
whole) and every updated parameter, within 1e-5 in fp32 (we see ~1e-7: the ranks sum
partial products in another order). The workers live in spmd.tp_library_checks (tests/spmd/); each
launch costs seconds, so one launch runs every case of a test.
"""

from __future__ import annotations

import json

import pytest
import torch

from multigpu.hf import TINY_LLAMA, build_causal_lm, hf_loss, write_tiny_llama_config
from multigpu.models import apply_activation_checkpointing, build_model, loss_from_logits
from multigpu.spmd import run_spmd
from multigpu.strategies.tp_plan import concrete_plan, gpt_plan, parallelize_gpt, parallelize_hf_causal_lm, split_qkv

TOLERANCE = 1e-5
CHECKS = "spmd.tp_library_checks:several"
SP, NO_LP, AC = {"sequence_parallel": True}, {"loss_parallel": False}, {"activation_checkpointing": True}
SAC = {"activation_checkpointing": "selective"}  # the functional collectives' results kept, not run again
GPT_CASES = [NO_LP, {}, {**SP, **NO_LP}, SP, AC, {**SP, **AC}, SAC, {**SP, **SAC}]


def assert_parity(results: list[list[dict]], cases: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        assert [r["case"] for r in per_rank] == cases
        for r in per_rank:
            where = f"rank {rank}, case {r['case']}"
            assert r["max_loss_diff"] <= TOLERANCE, (where, r)
            assert r["max_grad_diff"] <= TOLERANCE, (where, r)
            assert r["max_param_diff"] <= TOLERANCE, (where, r)
            assert r["loss_is_plain_tensor"], where


class FakeMesh:
    """Enough of a DeviceMesh for the checks that run before anything is distributed."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_matches_single_device(world_size):
    """With and without sequence parallelism, loss_parallel and activation checkpointing."""
    calls = [("parity", dict(model="gpt-tiny", cases=GPT_CASES)), ("seq_len_error", dict(seq_len=15))]
    if world_size == 4:  # TP along the "tp" lines of a dp 2 x tp 2 grid
        calls.append(("parity", dict(model="gpt-tiny", cases=[{}, SP], dp=2)))
    [parity, seq_error, *on_grid] = zip(*run_spmd(CHECKS, world_size, calls=calls))
    assert_parity(list(parity), GPT_CASES)
    for results in on_grid:
        assert_parity(list(results), [{}, SP])
        assert results[0][1]["local_hidden_shape"] == (4, 8, 64)  # the sequence cut in 2, not 4
    by_case = {json.dumps(r["case"], sort_keys=True): r for r in parity[0]}
    plain, sp = by_case[json.dumps(NO_LP)], by_case[json.dumps(SP)]
    # the tied head and embedding are still one parameter; both names are in the state dict
    assert all(r["tied"] for r in parity[0])
    assert {"wte.weight", "lm_head.weight"} <= set(plain["param_names"])
    assert plain["param_names"] == sp["param_names"]
    # every rank holds the whole sequence between sublayers, or under SP 1/N of it
    assert plain["local_hidden_shape"] == (4, 16, 64)
    assert sp["local_hidden_shape"] == (4, 16 // world_size, 64)
    # under SP the LayerNorms and the position table are DTensors too
    assert "blocks.0.ln_1.weight" not in plain["dtensor_params"]
    assert {"blocks.0.ln_1.weight", "ln_f.weight", "wpe.weight"} <= set(sp["dtensor_params"])
    # one all-reduce per sublayer each way (+ embedding forward, head input backward);
    # SP trades each all-reduce for a reduce-scatter and an all-gather
    layers = 2  # gpt-tiny
    assert plain["comm_calls"] == {"all_reduce": 2 * (2 * layers + 1), "all_gather": 1}  # + the logits, gathered
    # forward and backward each: 2L + 1 of each half; the position table's reduce-scatter
    # forward and its all-gather backward; loss_parallel's three all-reduces (max, target
    # logit, sum of exponentials), which DTensor issues inside the loss
    halves = 2 * (2 * layers + 1) + 1
    assert sp["comm_calls"] == {"reduce_scatter": halves, "all_gather": halves, "all_reduce": 3}
    assert all("tp 2 does not divide the 15 tokens" in e or "tp 4 does not divide the 15 tokens" in e
               for e in seq_error)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_llama_matches_single_device():
    """The config's own base_model_tp_plan, grouped-query attention (4 query, 2 kv heads);
    and the same model with its head tied to the embedding (both then cut by vocabulary)."""
    cases = [{}, NO_LP, AC]
    [untied, tied] = zip(*run_spmd(CHECKS, 2, calls=[("parity", dict(model="tiny-llama", cases=cases)),
                                                     ("parity", dict(model="tiny-llama-tied", cases=cases))]))
    assert_parity(list(untied), cases)
    assert_parity(list(tied), cases)
    sharded = set(untied[0][0]["dtensor_params"])
    layers = {"model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"}
    assert {"lm_head.weight", *layers} <= sharded
    assert "model.embed_tokens.weight" not in sharded  # the base plan leaves the embedding whole
    assert not any(r["tied"] for r in untied[0]) and all(r["tied"] for r in tied[0])
    assert "model.embed_tokens.weight" in tied[0][0]["dtensor_params"]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(tied[0][0]["param_names"])


def test_bad_tp_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tp 3 does not divide the 4 attention heads; use a tp that divides 4"):
        parallelize_gpt(build_model("gpt-tiny"), FakeMesh(3))
    with pytest.raises(ValueError, match=r"tp 8 does not divide the 4 attention heads"):
        parallelize_gpt(build_model("gpt-tiny"), FakeMesh(8))
    with pytest.raises(ValueError, match=r"tp 4 does not divide the 2 key/value heads"):
        parallelize_hf_causal_lm(_tiny_llama(), FakeMesh(4))


def test_plan_names_the_same_modules_with_activation_checkpointing():
    plain = concrete_plan(split_qkv(build_model("gpt-tiny")), gpt_plan(sequence_parallel=True))
    wrapped = concrete_plan(split_qkv(apply_activation_checkpointing(build_model("gpt-tiny"))),
                            gpt_plan(sequence_parallel=True))
    assert "blocks.1.attn.qkv.q" in plain and "blocks.1._checkpoint_wrapped_module.attn.qkv.q" in wrapped
    assert [k.replace("_checkpoint_wrapped_module.", "") for k in wrapped] == list(plain)
    # wte, wpe, ln_f, lm_head; per block attn, qkv.q/k/v, attn.proj, mlp, fc, mlp.proj, ln_1, ln_2
    assert len(plain) == 4 + 2 * 10


def _tiny_llama():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return build_causal_lm(write_tiny_llama_config(tmp))


def test_build_causal_lm_from_config(tmp_path):
    path = write_tiny_llama_config(tmp_path)
    assert path == tmp_path / "config.json" and json.loads(path.read_text())["model_type"] == "llama"
    a, b = build_causal_lm(path, seed=3), build_causal_lm(tmp_path, seed=3)  # the file or its folder
    assert type(a).__name__ == "LlamaForCausalLM"
    assert a.config.use_cache is False and a.config.num_key_value_heads == TINY_LLAMA["num_key_value_heads"]
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, build_causal_lm(path, seed=4).lm_head.weight)
    # labels are already the next tokens: the loss compares logits[t] with labels[t]
    ids = torch.randint(0, 256, (2, 9))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    assert torch.equal(hf_loss(a, batch), loss_from_logits(a(input_ids=batch["input_ids"]).logits, batch["labels"]))


@pytest.mark.parametrize("text, message", [
    (None, "no model config at"),
    ("{", "is not valid JSON"),
    ('{"model_type": "no-such-model"}', "model_type 'no-such-model', which transformers does not know"),
    ('{"model_type": "t5"}', "'t5' is not a causal language model"),
])
def test_build_causal_lm_errors(tmp_path, text, message):
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_causal_lm(path)
