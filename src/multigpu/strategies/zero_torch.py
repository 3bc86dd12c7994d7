"""ZeRO stage 1 from PyTorch's own parts: DDP all-reduces the gradients, and
`torch.distributed.optim.ZeroRedundancyOptimizer` keeps each rank's optimizer state for its
share of the parameters only, then broadcasts the updated parameters. It shares out whole
tensors (greedily, by size), not a flat buffer, so the shards are uneven.
"""

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from multigpu.strategies import Parallelized, optimizer_spec


def prepare(model, cfg, rt) -> Parallelized:
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    ddp_model = DDP(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb)
    cls, kwargs = optimizer_spec(cfg)
    optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=cls, **kwargs)
    return Parallelized(module=ddp_model, optimizer=optimizer, model=model, no_sync=ddp_model.no_sync)
