"""PyTorch's DistributedDataParallel.

DDP broadcasts rank 0's weights at construction, then during every backward all-reduces
gradients in buckets of about `bucket_cap_mb`, each launched as soon as its gradients are
ready, so communication overlaps the rest of backward. `no_sync()` skips the all-reduce
for the first micro-batches of a gradient-accumulation step.
"""

from torch.nn.parallel import DistributedDataParallel as DDP

from multigpu.strategies import Parallelized, build_optimizer


def wrap(model, cfg, rt) -> DDP:
    """The model in DDP, on this rank's GPU (device_ids) or on the CPU (None)."""
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb)


def prepare(model, cfg, rt) -> Parallelized:
    ddp_model = wrap(model, cfg, rt)
    optimizer = build_optimizer(ddp_model.parameters(), cfg)
    return Parallelized(module=ddp_model, optimizer=optimizer, model=model, no_sync=ddp_model.no_sync)
