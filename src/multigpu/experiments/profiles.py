"""The experiments of chapter "Time against the limit": one step of each strategy under torch's
profiler (its time by category, `multigpu.profiling`), and one device at growing batches, whose
products grow with the batch, and its MFU with them (`multigpu.estimator.flops.utilization`)."""

from __future__ import annotations

from multigpu.config import RunConfig
from multigpu.experiments.machine import ddp_device, on_gpus
from multigpu.experiments.model_parallel import tp_model


def step_profiles() -> list[RunConfig]:
    """One device at three batches, in fp32 and (on a GPU) bf16, and checkpointed at the middle one; then DDP,
    FSDP, tensor parallelism and a 1F1B pipeline on 2 ranks with the tensor-parallel chapter's model (one thread
    each on a CPU, as one GPU per rank; none on a machine of one GPU, whose records of two ranks would be a
    CPU's), each with its last step profiled and, on 2 ranks, each rank's trace kept beside the records for
    Perfetto (results/<machine>/traces/<strategy>/rank<r>.json.gz)."""
    model, seq, batches = ("gpt2", 512, (4, 16, 32)) if on_gpus() else ("gpt-small", 128, (2, 8, 32))
    base = RunConfig(model=model, seq_len=seq, steps=6, optimizer="adamw", lr=1e-3, dataset="dummy",
                     extra={"profile": True})
    runs = [base.replace(global_batch_size=b, dtype=d) for d in (("fp32", "bf16-mixed") if on_gpus() else ("fp32",))
            for b in batches]
    runs.append(base.replace(global_batch_size=batches[1], activation_checkpointing=True))  # HFU above MFU
    if on_gpus() and not on_gpus(2):
        return runs
    model, batch, seq = tp_model()  # on GPUs not gpt2, whose vocabulary does not split over 2 ranks
    ranks = base.replace(model=model, seq_len=seq, global_batch_size=batch, device=ddp_device(), world_size=2,
                         threads_per_worker=None if on_gpus(2) else 1)
    for strategy, accumulation in (("ddp", 1), ("fsdp", 1), ("tp", 1), ("pp-1f1b", 4)):
        runs.append(ranks.replace(strategy=strategy, grad_accum_steps=accumulation,
                                  extra={"profile": f"traces/{strategy}"}))
    return runs


def recomputation() -> list[RunConfig]:
    """Activation recomputation's trade: none, full and selective (`multigpu.recompute`) on one device, the three
    in turn three times (their step times compared within one sweep: none, full, selective, none, ...), then
    tensor parallelism at 2 and 4 ranks (one thread each on a CPU; as many GPUs as there are, at most 4), with and
    without sequence parallelism, in each mode: the activations a rank keeps, against Korthikanti et al.'s table."""
    tp_name, tp_batch, tp_seq = tp_model()  # (on GPUs not gpt2: its vocabulary does not split over 2 ranks)
    model, seq, batch = ("gpt2", 1024, 8) if on_gpus() else (tp_name, tp_seq, 2 * tp_batch)  # a CPU: one length
    base = RunConfig(model=model, seq_len=seq, global_batch_size=batch, steps=6, optimizer="adamw", lr=1e-3,
                     dataset="dummy")
    modes = (False, True, "selective")
    runs = [base.replace(activation_checkpointing=mode, extra={"repeat": repeat}) for repeat in range(3)
            for mode in modes]
    degrees = [t for t in (2, 4) if on_gpus(t)] if on_gpus(2) else [] if on_gpus() else [2, 4]
    ranks = base.replace(model=tp_name, seq_len=tp_seq, global_batch_size=tp_batch, strategy="tp", steps=3,
                         device=ddp_device(),
                         threads_per_worker=None if on_gpus(2) else 1)
    for t in degrees:
        for sp in (False, True):
            runs += [ranks.replace(world_size=t, activation_checkpointing=mode,
                                   extra={"sequence_parallel": True} if sp else {}) for mode in modes]
    return runs
