"""Mixture of experts and expert parallelism: the layer's routing, capacity and balancing loss
against their definitions; the expert-parallel layer against the same layer on one device
(output and every gradient, in float64, with and without dropped tokens), its all-to-all bytes
against the formula; and what cannot be cut refused before any process starts.

Training parity of ep-scratch against one device (fp32, 3 steps, 2 and 4 ranks, ep inside dp) is
in test_parity.py, with every other strategy's.
"""

from __future__ import annotations

import pytest
import torch

from multigpu import moe
from multigpu.config import ConfigError, RunConfig, with_strategy_defaults
from multigpu.spmd import run_spmd


def test_the_layer_is_its_definition_token_by_token():
    """Against the layer written out for one token at a time (float64): softmax over E scores, the
    top k renormalised, the chosen experts' GELU MLPs weighted and summed, plus the shared expert;
    the output and the gradients of the input, the router and the experts."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float64)
        try:
            layer = moe.MoE(8, moe.MoEConfig(4, top_k=2, d_ff=16, shared_experts=1))
            x = torch.randn(2, 5, 8, requires_grad=True)
        finally:
            torch.set_default_dtype(torch.float32)
    ex, tokens = layer.experts, x.reshape(-1, 8)
    probs = torch.softmax(tokens @ layer.router.weight.T, dim=-1)
    rows = []
    for t in range(tokens.shape[0]):
        weight, chosen = probs[t].topk(2)
        weight = weight / weight.sum()
        rows.append(layer.shared[0](tokens[t]) + sum(
            w * (torch.nn.functional.gelu(tokens[t] @ ex.fc_weight[e] + ex.fc_bias[e]) @ ex.proj_weight[e]
                 + ex.proj_bias[e]) for w, e in zip(weight, chosen)))
    reference = torch.stack(rows).view(2, 5, 8)
    out = layer(x)
    assert (out - reference).abs().max() < 1e-14
    wrt = [x, layer.router.weight, ex.fc_weight, ex.proj_bias]
    for a, b in zip(torch.autograd.grad(out.square().sum(), wrt), torch.autograd.grad(reference.square().sum(), wrt)):
        assert (a - b).abs().max() < 1e-13


def test_capacity_is_first_choices_first_in_token_order():
    """Capacity 2 per expert in a sequence of 4 tokens, top-2 over 2 experts: every token's first choice
    claims a place before any second choice does, and within a choice tokens go in order."""
    layer = moe.MoE(4, moe.MoEConfig(2, top_k=2, capacity_factor=0.5))  # ceil(0.5 x 4 x 2 / 2) = 2 places
    chosen = torch.tensor([[[0, 1], [0, 1], [0, 1], [1, 0]]])  # (batch 1, seq 4, k 2)
    keep = layer._within_capacity(chosen)
    # expert 0: first choices of tokens 0, 1, 2 -> tokens 0, 1 kept; expert 1: first choice of token 3,
    # then second choices of tokens 0, 1, 2 -> token 3 and token 0's second choice kept
    assert keep.tolist() == [[[True, True], [True, False], [False, False], [True, False]]]
    assert moe.capacity(1.25, 64, 2, 8) == 20 and moe.capacity(None, 64, 2, 8) is None
    assert moe.capacity(1.1, 100, 1, 1) == 110  # not the 111 of 1.1 x 100 in binary


def test_balancing_loss_is_one_when_even_and_the_count_of_experts_when_all_on_one():
    """Switch's aux = E x sum_i f_i P_i: 1 for an even load with even probabilities, E when every
    token goes to one expert with probability 1."""
    layer = moe.MoE(4, moe.MoEConfig(4, top_k=1, aux_loss_coef=1.0))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer(torch.randn(1, 8, 4))  # equal scores: topk picks expert 0 for all, probabilities 1/4
        assert layer.aux_loss.item() == pytest.approx(1.0)
        layer.router.weight.copy_(torch.tensor([[100.0, 0, 0, 0]] + [[0.0] * 4] * 3))
        layer(torch.ones(1, 8, 4))  # everything to expert 0, with probability ~1
        assert layer.aux_loss.item() == pytest.approx(4.0, rel=1e-6)
    assert layer.load[-1].tolist() == [8, 0, 0, 0, 0]


def test_every_token_meets_k_experts_without_a_limit():
    layer = moe.MoE(8, moe.MoEConfig(4, top_k=2))
    out = layer(torch.randn(3, 5, 8))
    assert out.shape == (3, 5, 8)
    assert layer.load[-1][:4].sum() == 3 * 5 * 2 and layer.load[-1][4] == 0


_layers: dict = {}


def layer(ep: int, **routing) -> list[dict]:
    key = (ep, tuple(sorted(routing.items())))
    if key not in _layers:
        _layers[key] = run_spmd("spmd.ep_checks:layer_checks", ep, **routing)
    return _layers[key]


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("routing", [dict(top_k=2), dict(top_k=1), dict(top_k=2, capacity_factor=0.5)],
                         ids=["top2", "top1", "capacity0.5"])
def test_expert_parallel_layer_is_the_one_device_layer(ep, routing):
    """Output, input gradient and every parameter's gradient (router, experts, shared expert) equal to
    one device's in float64, on every rank; the same tokens per expert and the same dropped."""
    for r in layer(ep, **routing):
        assert r["output"] < 1e-12 and r["input_grad"] < 1e-12, r
        assert max(r["param_grads"].values()) < 1e-12, r["param_grads"]
        assert r["same_load"]
        assert (r["dropped"] > 0) == ("capacity_factor" in routing)


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_are_the_formula(ep):
    """Per layer, forward: each rank sends the counts (E int64s), then dispatches the rows of its
    kept assignments and combines (sends back) the rows it received, d_model float64s each. A rank
    sends what its tokens chose and returns what others' chose, so the ranks together hand the
    all-to-alls 2 x k x d x 8 bytes a token when nothing is dropped (the formula); backward the same."""
    experts, d_model, k = 8, 16, 2
    ranks = layer(ep, top_k=k)
    tokens = sum(r["tokens"] for r in ranks)
    assert sum(r["forward_payload"]["all_to_all"] for r in ranks) == ep * 8 * experts + 2 * tokens * k * d_model * 8
    assert sum(r["payload"]["all_to_all"] for r in ranks) == ep * 8 * experts + 4 * tokens * k * d_model * 8
    ranks = layer(ep, top_k=2, capacity_factor=0.5)  # dropped assignments are not sent
    kept = ranks[0]["kept_assignments"]  # the whole batch's
    assert kept < tokens * k
    assert sum(r["forward_payload"]["all_to_all"] for r in ranks) == ep * 8 * experts + 2 * kept * d_model * 8


def refused(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        RunConfig(**fields).validate()
    return str(info.value)


def test_bad_input_is_refused_before_any_process_starts():
    m = dict(model="gpt-moe-tiny")
    message = refused(strategy="ep-scratch", world_size=3, global_batch_size=9, **m)
    assert "ep 3 (ep is every data-parallel rank, dp 3, unless --ep says otherwise) does not divide the 4 " \
           "experts" in message and message.endswith("use --ep 1")
    assert "top_k 5 (--top-k) must be a whole number from 1 to the 4 experts" in refused(
        strategy="ep-scratch", world_size=2, extra={"moe_top_k": 5}, **m)
    for bad in (0, -1.0, float("nan")):
        assert "capacity_factor (--capacity-factor) must be a positive number" in refused(
            strategy="ep-scratch", world_size=2, extra={"moe_capacity_factor": bad}, **m)
    assert "ep 3 does not divide dp 4" in refused(strategy="ep-scratch", world_size=4, ep=3, **m)
    assert "does not cut experts (ep=2)" in refused(strategy="ddp", world_size=2, ep=2, **m)
    assert "with single or fsdp or ep-scratch" in refused(strategy="ddp", world_size=2, **m)
    assert "composes with --ep here, not yet with --tp" in refused(strategy="fsdp", world_size=4, tp=2, **m)
    assert "fsdp --ep cuts a mixture of experts' experts" in refused(strategy="fsdp", world_size=2, ep=2)
    assert "gpt-tiny has none" in refused(strategy="ep-scratch", world_size=2)
    assert "--top-k routes a mixture of experts; gpt-tiny is not one of" in refused(strategy="single",
                                                                                   extra={"moe_top_k": 1})
    assert "does not combine with tp" in refused(strategy="ep-scratch", world_size=4, tp=2, **m)


def test_a_hugging_face_mixtral_takes_its_experts_over_ranks_with_deepspeed_moe(tmp_path):
    """A Mixtral config.json trains under the data-parallel strategies with every expert on every rank;
    over ep ranks with deepspeed-moe only, and routes as its config says."""
    from multigpu.hf import TINY_MIXTRAL, write_tiny_llama_config

    m = dict(model=str(write_tiny_llama_config(tmp_path / "config.json", TINY_MIXTRAL)), seq_len=32)
    for strategy, world_size, degrees in (("deepspeed-moe", 4, {"ep": 2}), ("fsdp", 2, {}), ("ddp", 2, {})):
        RunConfig(strategy=strategy, world_size=world_size, **degrees, **m).validate()
    assert "its experts go over ranks with --strategy deepspeed-moe" in refused(strategy="ep-scratch",
                                                                               world_size=2, **m)
    assert "fsdp --ep cuts this package's presets' experts" in refused(strategy="fsdp", world_size=2, ep=2, **m)
    assert "routes as its config.json says" in refused(strategy="ddp", world_size=2, extra={"moe_top_k": 1}, **m)
    assert "ep 3 does not divide the 4 experts" in refused(strategy="deepspeed-moe", world_size=3,
                                                           global_batch_size=9, **m)
    assert "'deepspeed-moe' does not combine with tp (tp=2); it takes --ep" in refused(
        strategy="deepspeed-moe", world_size=4, tp=2, **m)


@pytest.mark.parametrize("world_size, ep, expected", [(4, None, 4), (4, 2, 2), (4, 1, 1), (2, None, 2)])
def test_ep_degrees(world_size, ep, expected):
    cfg, _ = with_strategy_defaults(RunConfig(strategy="ep-scratch", world_size=world_size, ep=ep))
    cfg.validate()
    assert cfg.model == "gpt-moe-tiny" and cfg.grid.ep == expected and cfg.grid.dp == world_size
    assert cfg.degrees.get("ep", 1) == expected


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_the_estimator_keeps_a_ranks_share_of_the_experts(ep):
    """Parameters a rank keeps under ep-scratch: the dense part whole and 1/ep of every layer's
    experts, counted on the model itself; the active parameters: k of E experts per token."""
    from multigpu.estimator.model_trace import model_shape
    from multigpu.estimator.peak import estimate
    from multigpu.estimator.question import Setup
    from multigpu.models import build_model

    model = build_model("gpt-moe-small")
    routed = sum(p.numel() for layer in moe.layers(model) for p in layer.experts.parameters())
    total = sum(p.numel() for p in model.parameters())
    est = estimate(Setup("gpt-moe-small", "ep-scratch", world_size=4, ep=ep, optimizer="adamw"))
    assert est.per_rank_bytes["params"] == 4 * (total - routed + routed // ep)
    assert est.per_rank_bytes["optimizer"] == 8 * (total - routed + routed // ep)
    shape = model_shape("gpt-moe-small")
    assert shape.active_parameters == total - routed + routed * 2 // 8


# -- the chapter's formulas, each against what did not use it --------------------------------


def test_expert_parameters_are_what_the_models_hold():
    """The routed experts' count against the models: this package's gpt-moe-small (GELU, biases) and
    Mixtral 8x7B and DeepSeek-V3 as transformers builds them from their configs (gated, no biases),
    whose totals and active parameters are also the published ones (within 1%)."""
    from multigpu.estimator.formulas import moe_active_parameters, moe_expert_parameters
    from multigpu.hf import counted_on_meta
    from multigpu.models import GPT_SIZES, build_model
    from multigpu.sources import DEEPSEEK_V3, MIXTRAL_8X7B

    small = GPT_SIZES["gpt-moe-small"]
    model = build_model("gpt-moe-small")
    assert moe_expert_parameters(small.d_model, 4 * small.d_model, small.moe.experts, small.n_layer, gated=False,
                                 biases=True) == sum(p.numel() for layer in moe.layers(model)
                                                     for p in layer.experts.parameters())
    for published, moe_layers in ((MIXTRAL_8X7B, 32), (DEEPSEEK_V3, 58)):  # DeepSeek-V3: its first 3 layers dense
        c = published.config
        experts = c.get("num_local_experts") or c["n_routed_experts"]
        width = c.get("moe_intermediate_size") or c["intermediate_size"]
        counted = counted_on_meta(c)
        assert moe_expert_parameters(c["hidden_size"], width, experts, moe_layers) == counted["expert_parameters"]
        active = moe_active_parameters(counted["parameters"], counted["expert_parameters"], experts,
                                       c["num_experts_per_tok"])
        assert counted["parameters"] / 1e9 == pytest.approx(published.total_b, rel=0.01)
        assert active / 1e9 == pytest.approx(published.active_b, rel=0.02)


def test_dropped_share_under_uniform_routing_is_the_binomial_tail():
    """The expected dropped share when tokens choose k distinct experts uniformly at random, against
    the layer's own capacity rule applied to random choices (20,000 sequences)."""
    from multigpu.estimator.formulas import dropped_share_uniform

    torch.manual_seed(0)
    seqs, tokens, k, experts = 20000, 32, 2, 8
    layer = moe.MoE(4, moe.MoEConfig(experts, top_k=k))
    chosen = torch.rand(seqs, tokens, experts).argsort(dim=-1)[..., :k]  # k distinct experts per token
    for factor in (0.5, 1.0, 1.25):
        layer.capacity_factor = factor
        dropped = 1 - layer._within_capacity(chosen).float().mean().item()
        assert dropped == pytest.approx(dropped_share_uniform(factor, tokens, k, experts), abs=0.003)
    assert dropped_share_uniform(4.0, tokens, k, experts) == 0.0


def test_the_estimator_refuses_a_mixture_of_experts_under_tp_pp_or_cp_with_the_reason():
    """As RunConfig refuses them (ep_scratch.expert_problems): the calculator's grid asks every
    strategy and tp of every model, gpt-moe-small's included, and takes a ConfigError as the answer."""
    from multigpu.estimator import Setup, estimate

    for options in ({"strategy": "fsdp", "tp": 2}, {"strategy": "fsdp", "cp": 2}):
        with pytest.raises(ConfigError, match="not yet with tensor, pipeline or context parallelism"):
            estimate(Setup("gpt-moe-small", world_size=4, **options))
    with pytest.raises(ConfigError, match="not pp-1f1b"):
        estimate(Setup("gpt-moe-small", "pp-1f1b", 4, grad_accum_steps=4))


@pytest.mark.slow
def test_deepspeed_moes_gate_scores_in_fp32_under_bf16_autocast():
    """strategies/deepspeed_moe.py says DeepSpeed's gate computes in fp32 as moe.MoE's router does: under
    bf16-mixed's autocast its scores, choices and counts are the fp32 ones exactly, where DeepSpeed's own forward
    (which casts to fp32 but leaves autocast on) computes the product in bf16 (gpu-path-3, section 4)."""
    found = run_spmd("spmd.moe_gate_checks:gate_under_autocast", 1)[0]
    assert found["library"] > 1e-4, found  # bf16's rounding shows: the check can tell
    assert found["package"] == 0, found
