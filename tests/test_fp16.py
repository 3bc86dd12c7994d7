"""fp16-mixed: float16 autocast with the loss scaled by torch.amp.GradScaler (strategies.LossScaler).

Fast, in this process, on gpt-tiny: that it trains, that the scaler really scales the
gradients backward produces and unscales them before the update (with gradient
accumulation), that a step whose gradients overflow is skipped and the scale halved, and
that strategies where a plain GradScaler is wrong are refused before anything starts."""

from __future__ import annotations

import math

import pytest
import torch

from multigpu import config, strategies
from multigpu.config import ConfigError, RunConfig
from multigpu.data import TokenDataset
from multigpu.models import build_model, compute_loss, vocab_size
from multigpu.runtime import RankGrid, Runtime
from multigpu.train import train

CPU = torch.device("cpu")


def _runtime() -> Runtime:
    rt = Runtime(0, 0, 1, CPU, "gloo")
    rt.grid = RankGrid.build("cpu")
    return rt


def _batches(cfg: RunConfig, n: int) -> list[dict]:
    """n micro-batches of cfg's micro-batch size (the learnable synthetic task)."""
    data = TokenDataset(cfg.model, "synthetic", n * cfg.micro_batch_size, cfg.seq_len, vocab_size(cfg.model), cfg.seed)
    samples = [data[i] for i in range(len(data))]
    size = cfg.micro_batch_size
    return [{k: torch.stack([s[k] for s in samples[i * size:(i + 1) * size]]) for k in samples[0]}
            for i in range(n)]


def test_fp16_mixed_trains_with_a_scaled_loss():
    cfg = RunConfig(model="gpt-tiny", dtype="fp16-mixed", optimizer="adamw", lr=3e-3, steps=6,
                    global_batch_size=8, grad_accum_steps=2, seq_len=32, track_memory=False).validate()
    out = train(cfg, _runtime())
    assert all(math.isfinite(x) for x in out["loss"])
    assert out["loss"][-1] < out["loss"][0]
    scaling = out["strategy_report"]["loss_scaling"]
    assert len(scaling["loss_scale_by_step"]) == cfg.steps
    assert scaling["loss_scale_by_step"][0] == torch.amp.GradScaler("cpu").get_scale()  # 2**16
    assert scaling["skipped_steps"] == []


def test_fp32_and_bf16_runs_have_no_scaler():
    cfg = RunConfig(model="gpt-tiny", dtype="bf16-mixed", steps=1, global_batch_size=2, seq_len=16,
                    track_memory=False).validate()
    assert "loss_scaling" not in train(cfg, _runtime())["strategy_report"]


def test_backward_sees_scaled_gradients_and_the_update_unscaled_ones_with_accumulation():
    """Gradients after backward are the true ones times the scale; the optimizer steps with
    gradients divided by it again, which over two micro-batches equal fp32's gradient of the
    whole batch (to fp16's precision)."""
    cfg = RunConfig(model="gpt-tiny", dtype="fp16-mixed", optimizer="sgd", global_batch_size=4,
                    grad_accum_steps=2, seq_len=32).validate()
    micro = _batches(cfg, 2)
    whole = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}

    reference = build_model(cfg.model, cfg.seed)
    compute_loss(reference, whole).backward()  # fp32, one batch
    ref = torch.cat([p.grad.flatten() for p in reference.parameters()])

    model = build_model(cfg.model, cfg.seed)
    par = strategies.prepare(model, cfg, _runtime())
    assert isinstance(par.scaler, strategies.LossScaler)
    after_backward, at_update = [], []
    plain_backward = par.backward

    def backward(loss):
        plain_backward(loss)
        after_backward.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())

    par.backward = backward
    par.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: at_update.append(torch.cat([p.grad.flatten() for p in model.parameters()])))
    strategies.micro_batch_step(par, micro, torch.float16)

    scale = par.scaler.scale_by_step[0]
    assert scale > 1
    assert abs(after_backward[-1].norm() / (scale * ref.norm()) - 1) < 1e-2  # summed, still scaled
    assert torch.allclose(after_backward[-1] / scale, ref, rtol=1e-2, atol=1e-4)
    assert torch.allclose(at_update[0], ref, rtol=1e-2, atol=1e-4)  # unscaled before the step
    assert torch.nn.functional.cosine_similarity(at_update[0], ref, dim=0) > 0.999


def test_an_overflow_skips_the_step_and_halves_the_scale():
    cfg = RunConfig(model="gpt-tiny", dtype="fp16-mixed", optimizer="adamw", global_batch_size=2,
                    seq_len=16).validate()
    model = build_model(cfg.model, cfg.seed)
    par = strategies.prepare(model, cfg, _runtime())
    batches = _batches(cfg, 3)
    inject = {"now": False}
    first = next(model.parameters())
    first.register_hook(lambda g: torch.full_like(g, math.inf) if inject["now"] else g)

    def weights():
        return [p.detach().clone() for p in model.parameters()]

    strategies.micro_batch_step(par, [batches[0]], torch.float16)  # a clean step
    before = weights()
    inject["now"] = True
    loss = strategies.micro_batch_step(par, [batches[1]], torch.float16)
    inject["now"] = False
    assert math.isfinite(loss)  # the loss was fine: only a gradient overflowed
    assert all(torch.equal(a, b) for a, b in zip(before, weights()))  # no parameter moved
    assert par.scaler.skipped_steps == [1]
    strategies.micro_batch_step(par, [batches[2]], torch.float16)
    assert par.scaler.scale_by_step == [2.0**16, 2.0**16, 2.0**15]  # halved after the overflow
    assert not all(torch.equal(a, b) for a, b in zip(before, weights()))  # and the next step updates


REFUSED = [s for s in config.STRATEGIES if s not in config.FP16_STRATEGIES]


@pytest.mark.parametrize("strategy", REFUSED)
def test_strategies_without_a_plain_grad_scaler_are_refused(strategy):
    info = config.STRATEGY_TABLE[strategy]
    pipeline = {"model": "gpt-mini", "grad_accum_steps": 4} if info.spans == "pp" else {}
    if info.spans_experts:  # it trains a mixture of experts
        pipeline = {"model": "gpt-moe-tiny"}
    fine = RunConfig(strategy=strategy, world_size=2, dtype="bf16-mixed", **pipeline)
    fine.validate()  # the same run in bf16 is accepted: the refusal is fp16's alone
    with pytest.raises(ConfigError) as refused:
        fine.replace(dtype="fp16-mixed").validate()
    message = str(refused.value)
    assert "supported with strategies single, ddp, dp only" in message
    assert f"not {strategy!r}" in message
    assert "Use dtype 'bf16-mixed'" in message
    if info.module in ("fsdp", "fsdp1"):
        assert "ShardedGradScaler" in message
    if info.module == "deepspeed":
        assert "fp16 section" in message


@pytest.mark.parametrize("strategy", config.FP16_STRATEGIES)
def test_single_ddp_and_dp_accept_fp16_mixed(strategy):
    RunConfig(strategy=strategy, world_size=1 if strategy == "single" else 2, dtype="fp16-mixed").validate()
