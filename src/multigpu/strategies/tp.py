"""The `tp` strategy: tensor parallelism with PyTorch's library, alone on the grid.

The model goes through the order of `compose.py` with tensor parallelism only: the plan of
`tp_plan.py` (every weight matrix cut over the tp ranks, a DTensor), then activation
checkpointing if asked. Every rank feeds the same batch, and each updates its own slices.

Options (RunConfig.extra): `sequence_parallel` (default False), `loss_parallel` (default True).
"""

from __future__ import annotations

from multigpu.strategies import Parallelized, build_optimizer, compose
from multigpu.strategies.state import whole_state_dict


def config_problems(cfg) -> list[str]:
    """What RunConfig.validate reports before any process starts."""
    from multigpu.models import family

    if cfg.extra.get("sequence_parallel") and family(cfg.model) != "gpt":
        return ["sequence_parallel is implemented for the package's GPT only; run a Hugging Face model "
                "without --sequence-parallel"]
    return []


def prepare(model, cfg, rt) -> Parallelized:
    module = compose.parallelize(model, cfg, rt.grid, shard=False)
    optimizer = build_optimizer(model.parameters(), cfg)  # DTensor parameters: each rank updates its shard

    return Parallelized(module=module, optimizer=optimizer, model=model, backward=module.backward,
                        gather_state_dict=lambda: whole_state_dict(model))
