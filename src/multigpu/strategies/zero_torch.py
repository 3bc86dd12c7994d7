"""ZeRO stage 1 from PyTorch's own parts: DDP all-reduces the gradients, and
`torch.distributed.optim.ZeroRedundancyOptimizer` keeps each rank's optimizer state for its
share of the parameters only, then broadcasts the updated parameters. It shares out whole
tensors (greedily, by size), not a flat buffer, so the shards are uneven.
"""

from torch.distributed.optim import ZeroRedundancyOptimizer

from multigpu.strategies import Parallelized, ddp, optimizer_spec


def prepare(model, cfg, rt) -> Parallelized:
    ddp_model = ddp.wrap(model, cfg, rt)
    cls, kwargs = optimizer_spec(cfg)
    optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=cls, **kwargs)
    # each rank's optimizer holds the state of its own whole tensors: saved under the rank's keys
    return Parallelized(module=ddp_model, optimizer=optimizer, model=model, no_sync=ddp_model.no_sync,
                        checkpoint_names="local")
