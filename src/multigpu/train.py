"""The one training loop every strategy shares.

The loop owns the data and the order of things; the step itself (forward and backward over
the micro-batches, then the update) is a function the strategy provides (`Parallelized.run_step`:
the plain micro-batch step, or a pipeline schedule), and what is measured around each step
(time, memory, traffic) is `instruments.Instruments`'s.
"""

from __future__ import annotations

import math
import os
import signal

import torch

from multigpu import checkpoint, moe, strategies
from multigpu.config import RunConfig, parse_fault
from multigpu.data import TokenDataset, batches, make_loader
from multigpu.hf import set_attention
from multigpu.instruments import Instruments
from multigpu.memory import ProcessPeaks, model_state_bytes
from multigpu.models import build_model, default_seq_len, vocab_size
from multigpu.runtime import RankGrid, restart_count


def _maybe_fail(cfg: RunConfig, rank: int, step: int, stage: str | None = None) -> None:
    """Testing hook: make one rank fail at one step (or at one stage of a save), to prove failures never
    hang and that a checkpoint survives them. Once: a worker torchrun restarted does not fail again."""
    if cfg.fault is None or restart_count():
        return
    kind, fault_rank, fault_step, fault_stage = parse_fault(cfg.fault)
    if (rank, step, stage) == (fault_rank, fault_step, fault_stage):
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        where = f"at step {step}" if stage is None else f"in the save after step {step}, at stage {stage!r}"
        raise RuntimeError(f"injected fault on rank {rank} {where} (fault={cfg.fault!r})")


def resume_from(cfg: RunConfig) -> str | None:
    """The checkpoint a run continues from: the one asked for, or, in a worker torchrun restarted after a
    failure, the newest its own checkpoint_dir holds (none: it starts again from step 0)."""
    if cfg.resume is not None:
        return cfg.resume
    if restart_count() and cfg.checkpoint_dir and checkpoint.complete(cfg.checkpoint_dir):
        return cfg.checkpoint_dir
    return None


def train(cfg: RunConfig, rt, keep_params: bool = False) -> dict:
    """Train `cfg.steps` optimizer steps; return this rank's measurements, and with
    `keep_params` the whole trained weights (gathered from the shards: only when asked,
    because a full copy of a large model costs as much memory as the model)."""
    rt.grid = RankGrid.build(rt.device.type, cfg.process_grid)
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    machine = ProcessPeaks(rt.device)  # its baseline: before the model exists
    if (cap := cfg.extra.get("cuda_memory_cap_bytes")) and rt.device.type == "cuda":  # as on a smaller GPU
        total = torch.cuda.get_device_properties(rt.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), rt.device)
    model = build_model(cfg.model, cfg.seed)
    moe.configure(model, cfg.extra)  # a mixture of experts' routing options (none change a shape)
    if attention := cfg.extra.get("attention"):  # a T5 (config.py checks)
        set_attention(model, attention)
    model.to(rt.device)
    parameters = sum(p.numel() for p in model.parameters())  # before sharding hides them
    par = strategies.prepare(model, cfg, rt)
    # from here on the strategy's own references keep what it trains (par.model, its stages);
    # ours would keep the whole model alive, on the device, until training ends, wherever a
    # strategy trains copies or pieces of it rather than the model itself
    del model
    # a process driving several GPUs (dp) reads every one's peak: each step resets them all
    machine.reset_also(getattr(par.module, "peak_devices", ()))

    steps_done, losses, resumed = 0, [], None
    if path := resume_from(cfg):  # the weights, the optimizer's state, the generators; where the data stand
        resumed = checkpoint.load(path, par, cfg, rt)
        # this rank's restored losses: its own list, which training extends (the record keeps the saved run's)
        steps_done, losses = resumed["steps_done"], list(resumed.pop("rank_losses"))
    saver = checkpoint.Checkpointer(cfg, rt, par, lambda stage, s: _maybe_fail(cfg, rt.rank, s, stage)) \
        if cfg.checkpoint_dir else None

    seq_len = cfg.seq_len or default_seq_len(cfg.model)
    dataset = TokenDataset(cfg.model, cfg.dataset, cfg.num_samples, seq_len, vocab_size(cfg.model), cfg.seed)
    # data are split by data-parallel rank: the ranks of one tensor-parallel group (and of
    # one pipeline) see the same samples. A process's share of a micro-step (dp: one
    # process feeds all its replicas)
    dp_rank, dp_size = rt.grid.coord("dp"), rt.grid.size("dp")
    process_batch = cfg.global_batch_size // (dp_size * cfg.grad_accum_steps)
    loader, sampler = make_loader(dataset, process_batch, dp_rank, dp_size, cfg.seed)
    micro_steps_per_epoch = (cfg.num_samples // cfg.global_batch_size) * cfg.grad_accum_steps
    data = batches(loader, sampler, micro_steps_per_epoch, cfg.steps * cfg.grad_accum_steps,
                   start=steps_done * cfg.grad_accum_steps)
    # mixed precision: forward under autocast to this dtype, weights and optimizer in fp32
    # (fp16-mixed also scales the loss: par.scaler, set by strategies.prepare)
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(cfg.dtype)

    instruments = Instruments(cfg, rt, par, machine, first_step=steps_done)
    for step in range(steps_done, cfg.steps):
        _maybe_fail(cfg, rt.rank, step)
        with instruments.step(step - steps_done) as before_forward:
            micro_batches = [{k: v.to(rt.device, non_blocking=True) for k, v in next(data).items()}
                             for _ in range(cfg.grad_accum_steps)]
            step_loss = par.run_step(micro_batches, autocast_dtype, before_forward)
            if not math.isfinite(step_loss):  # every strategy's run stops here, nothing is recorded
                raise FloatingPointError(
                    f"training diverged at step {step}: the loss is {step_loss} (after "
                    f"{', '.join(f'{x:.4g}' for x in losses[-3:]) or 'no finite step'}); likely causes: a learning "
                    f"rate too high (lr={cfg.lr:g}: try 10x smaller), or half precision without loss scaling")
        losses.append(step_loss)
        instruments.progress(step, step_loss)
        if saver and saver.due(step + 1):
            saver.save(step + 1, losses)
    if saver and steps_done == cfg.steps:  # nothing to train: the checkpoint saved again under this layout
        saver.save(steps_done, losses)
    if saver:
        saver.close()  # an asynchronous save still in flight

    return {
        "rank": rt.rank,
        "loss": losses,
        **instruments.results(),
        "model_states": model_state_bytes(par.module, par.optimizer),  # what this rank holds between steps
        "strategy_report": {**(par.report() if par.report else {}),
                            **({"loss_scaling": par.scaler.report()} if par.scaler else {})},
        "state_dict": par.full_state_dict() if keep_params else None,
        "seq_len": seq_len,
        "parameters": parameters,
        "moe": moe.report(par.model),  # a mixture of experts' routing: tokens per expert, dropped
        "checkpoint": {"saves": saver.saves if saver else [], "resumed": resumed},
    }
