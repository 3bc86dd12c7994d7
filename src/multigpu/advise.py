"""Which strategy, from the estimator's numbers: the sources' decision guide as code.

The guide (Hugging Face's "efficient training on many GPUs", after the ZeRO and Megatron
papers):
1. The model fits on one GPU: data parallelism (DDP). ZeRO can buy a larger batch.
2. It does not fit: shard it (ZeRO-3 / FSDP), or cut it (pipeline, tensor parallelism).
3. Its largest layer does not fit on one GPU: only tensor parallelism cuts inside a layer.
4. Several nodes over slow links: keep the heavy traffic inside a node (tensor parallelism),
   pipeline across nodes, and shard only the optimizer state (DP + PP + TP + ZeRO-1).

Every number in the answer is the estimator's (`multigpu.estimate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from multigpu.config import ConfigError
from multigpu.estimate import Setup, estimate, largest_batch, model_shape

INTERCONNECTS = ("fast", "slow")  # fast: NVLink / InfiniBand class; slow: Ethernet class between nodes


@dataclass
class Advice:
    strategy: str
    reasons: list[str]
    per_gpu_bytes: int | None = None  # at the largest batch, or the model states alone
    max_global_batch: int | None = None
    compared: dict = field(default_factory=dict)  # strategy -> largest global batch (0: does not fit)

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "reasons": self.reasons, "per_gpu_bytes": self.per_gpu_bytes,
                "max_global_batch": self.max_global_batch, "compared": self.compared}


def advise(base: Setup, gpus: int, memory_bytes: int, nodes: int = 1, interconnect: str = "fast") -> Advice:
    """Recommend a strategy for `base.model` (its dtype, optimizer, lengths) on `gpus` GPUs
    of `memory_bytes` each, spread over `nodes` nodes."""
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise ConfigError(f"--gpus ({gpus}) must be a positive multiple of --nodes ({nodes})")
    if interconnect not in INTERCONNECTS:
        raise ConfigError(f"--interconnect must be one of {', '.join(INTERCONNECTS)}, got {interconnect!r}")
    size, name = _size(memory_bytes), Path(base.model).stem  # a config file by its name, not its path

    def best(strategy: str, n: int):
        return largest_batch(replace(base, strategy=strategy, world_size=n), memory_bytes)

    one = best("single", 1)
    shape = model_shape(base.model)
    compared = {"single": one.global_batch if one else 0}
    for s in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        if gpus > 1:
            found = best(s, gpus)
            compared[s] = found.global_batch if found else 0
    if one is not None:
        ddp = best("ddp", gpus) if gpus > 1 else one
        reasons = [f"{name} trains on one {size} GPU: up to {one.global_batch} samples per step "
                   f"({_size(one.per_rank_bytes['total'])} at that batch)."]
        if gpus == 1:
            return Advice("single", reasons, one.per_rank_bytes["total"], one.global_batch, compared)
        if ddp is None:  # DDP's buckets hold a second copy of the gradients
            return _without_ddp(base, gpus, best, reasons, compared)
        reasons.append(f"Data parallelism (DDP) on {gpus} GPUs keeps a whole copy on each and runs "
                       f"{ddp.global_batch} samples per step, with one all-reduce of the gradients per step.")
        zero2 = compared.get("zero2", 0)
        if zero2 > ddp.global_batch:
            reasons.append(f"For a larger batch, ZeRO-2 shards the optimizer state and gradients: "
                           f"{zero2} samples per step for the same bytes sent.")
        if nodes > 1 and interconnect == "slow":
            reasons.append("Across slow links between nodes, DDP's all-reduce of every gradient is the cost "
                           "to watch: accumulate gradients over several micro-batches to send less often.")
        return Advice("ddp", reasons, ddp.per_rank_bytes["total"], ddp.global_batch, compared)
    # ZeRO-3 gathers a block whole, and makes its whole gradient before reduce-scattering it
    layer = Setup(f"params:{shape.largest_block}", "single", 1, optimizer="sgd", dtype=base.dtype)
    layer_bytes = estimate(layer).per_rank_bytes["total"]
    alone = replace(base, strategy="single", world_size=1)
    reasons = [f"{name} does not train on one {size} GPU: one sample needs "
               f"{_size(estimate(alone, 1).per_rank_bytes['total'])}, of which the model states are "
               f"{_size(estimate(alone).per_rank_bytes['total'])}."]
    if layer_bytes > memory_bytes:
        reasons.append(f"Its largest block's weights and gradients ({_size(layer_bytes)}) do not fit on one GPU "
                       "either: only tensor parallelism splits a layer (no chapter of this book runs it yet).")
        return Advice("tp", reasons, None, None, compared)
    if nodes > 1 and interconnect == "slow":
        reasons.append("Between nodes over slow links, keep the heavy traffic inside a node: tensor parallelism "
                       "within a node, pipeline stages across nodes, and ZeRO-1 for the optimizer state "
                       "(DP + PP + TP + ZeRO-1); this book does not run that combination yet.")
        return Advice("dp+pp+tp+zero1", reasons, None, None, compared)
    sharded = best("fsdp", gpus) if gpus > 1 else None
    if sharded is None:
        reasons.append(f"Sharding everything over {gpus} GPU(s) (ZeRO-3 / FSDP) is not enough either: "
                       "add GPUs, offload the optimizer state, or checkpoint activations.")
        return Advice("more GPUs", reasons, None, None, compared)
    reasons.append(f"Sharded over {gpus} GPUs (FSDP / ZeRO-3: parameters, gradients and optimizer state), "
                   f"it runs {sharded.global_batch} samples per step, {_size(sharded.per_rank_bytes['total'])} "
                   "per GPU, and sends 3 Psi bytes per step against DDP's 2 Psi (the parameters are gathered "
                   "twice).")
    if interconnect == "slow" or nodes > 1:
        reasons.append("Pipeline parallelism sends less than ZeRO-3 when the links are slow.")
    return Advice("fsdp", reasons, sharded.per_rank_bytes["total"], sharded.global_batch, compared)


def _without_ddp(base: Setup, gpus: int, best, reasons: list[str], compared: dict) -> Advice:
    """The model trains on one GPU, but not with DDP beside it: DDP's buckets hold a second
    copy of the gradients. Sharding the optimizer state and gradients (ZeRO-2, ZeRO-1) costs
    no more bytes sent; sharding the parameters too (FSDP) does."""
    reasons.append(f"DDP does not fit: its buckets hold a second copy of the gradients "
                   f"({_size(estimate(replace(base, strategy='single', world_size=1)).per_rank_bytes['grads'])}).")
    for strategy, why in (("zero2", "ZeRO-2 shards the optimizer state and gradients"),
                          ("zero1", "ZeRO-1 shards the optimizer state"),
                          ("fsdp", "FSDP shards the parameters, gradients and optimizer state, and sends 3 Psi "
                                   "bytes per step against DDP's 2 Psi")):
        if compared.get(strategy):
            found = best(strategy, gpus)
            reasons.append(f"{why}: {found.global_batch} samples per step on {gpus} GPUs, "
                           f"{_size(found.per_rank_bytes['total'])} per GPU.")
            return Advice(strategy, reasons, found.per_rank_bytes["total"], found.global_batch, compared)
    reasons.append("No data-parallel strategy fits beside the model on these GPUs: add GPUs or memory.")
    return Advice("more GPUs", reasons, None, None, compared)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
