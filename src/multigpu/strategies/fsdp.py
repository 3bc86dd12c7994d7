"""FSDP2: `torch.distributed.fsdp.fully_shard`, once per transformer block, then the root.

Each call makes a unit: its parameters become DTensors sharded over the ranks (dim 0). In
forward a unit all-gathers its parameters just before use and, with
`reshard_after_forward=True` (ZeRO-3-like), frees them after; in backward it gathers them
again, and reduce-scatters the gradients so each rank keeps its shard. With
`reshard_after_forward=False` (ZeRO-2-like) the gathered parameters stay from forward to
backward: one all-gather fewer, more memory. Options (RunConfig.extra):
`reshard_after_forward` (default True); `wrap`: "blocks" (default) or "root" (the whole
model one unit: everything is gathered at once, so the peak holds every parameter).
dtype bf16-mixed adds a MixedPrecisionPolicy: bf16 parameters for compute, fp32 gradient
reduction.

Option `replicas` (--hsdp-replicas R): hybrid sharding (HSDP), the dp ranks cut into R
groups, each sharding the model, the groups replicas of each other (`compose.hybrid_mesh`).

With `--tp N` it is 2D: tensor parallel inside each group of N consecutive ranks, FSDP
across the groups (the order in `compose.py`); each parameter is then a 2-D DTensor. With
`--ep N` (a mixture of experts) each layer's experts are cut over runs of N ranks and each slice
sharded over the ranks that hold it (`ep_scratch.shard_experts`), the rest over every rank.
"""

from contextlib import contextmanager

from multigpu.strategies import Parallelized, build_optimizer, compose, ep_scratch
from multigpu.strategies.state import whole_state_dict


def config_problems(cfg) -> list[str]:
    """What RunConfig.validate reports before any process starts."""
    replicas, dp = cfg.extra.get("replicas", 1), cfg.degrees["dp"]
    if not isinstance(replicas, int) or replicas < 1 or dp % replicas:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        return [f"hybrid sharding cuts the {dp} data-parallel ranks into replicas groups: replicas={replicas!r} "
                f"must be a whole number dividing {dp} ({', '.join(map(str, divisors))})"]
    return []


def prepare(model, cfg, rt) -> Parallelized:
    reshard = bool(cfg.extra.get("reshard_after_forward", True))
    module = compose.parallelize(model, cfg, rt.grid, shard=True, reshard_after_forward=reshard)
    optimizer = build_optimizer(model.parameters(), cfg)

    @contextmanager
    def no_sync():  # accumulate unsharded gradients; reduce-scatter on the last micro-batch
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return Parallelized(module=module, optimizer=optimizer, model=model, no_sync=no_sync,
                        backward=getattr(module, "backward", None),
                        gather_state_dict=lambda: ep_scratch.gather_experts(model, whole_state_dict(model)),
                        # with --ep, a DTensor of an ep rank's experts is that rank's rows only: saved as its own
                        checkpoint_names="local" if cfg.grid.ep > 1 else "canonical")
