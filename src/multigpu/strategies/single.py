"""One process, one device: the reference every other strategy must match."""

from multigpu.strategies import Parallelized, build_optimizer


def prepare(model, cfg, rt) -> Parallelized:
    return Parallelized(module=model, optimizer=build_optimizer(model.parameters(), cfg), model=model)
