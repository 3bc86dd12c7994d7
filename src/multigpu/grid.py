"""The rank grid a run asks for, resolved once: `resolve_grid` turns a strategy's row, the
world size and any degrees given (--tp, --pp, --cp, --dp) into a `Grid`, or says with the arithmetic
why they cannot tile the world. The config, the estimator, the process groups (runtime.RankGrid)
and every record read this one answer (torchtitan does it once in ParallelDims, picotron with
one assert in its process-group manager).

The rule: a strategy's own name spans what the degrees given leave. `tp --world-size 4` is
tp 4; `fsdp --world-size 8 --tp 2` is dp 4 x tp 2; a pipeline spans what tp and dp leave, and
when its pp is given, the ranks left over are data-parallel ranks if it takes them (FSDP inside
each stage): `pp-1f1b --world-size 8 --pp 2 --tp 2` is dp 2 x pp 2 x tp 2. Context parallelism
(cp) is one more such degree: `cp-scratch --world-size 4` is cp 4, `fsdp --world-size 4 --cp 2`
is dp 2 x cp 2.

Expert parallelism (ep) is not a further factor: it cuts the experts of a mixture-of-experts
model over ranks that are data-parallel ranks for everything else (as torchtitan and Megatron
do), so ep divides dp. `ep-scratch --world-size 4` is dp 4 with ep 4 (each rank a quarter of
the experts); `--ep 2` is dp 4 with ep 2 (two copies of each half); `--ep 1` is plain data
parallel of the same model. `fsdp --ep 2` shards each half over its copies (FSDP's default is ep 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.errors import ConfigError
from multigpu.strategy_table import STRATEGY_TABLE

# The grid's dimensions, outermost first (torchtitan's order). Tensor parallelism is the
# innermost: its ranks are consecutive, which on a GPU server means the GPUs of one node,
# joined by the fastest links, because TP talks in every layer. Pipeline stages are the
# outermost: they exchange only activations between neighbours, the least traffic. Context
# parallelism sits between dp and tp: its ranks pass keys and values in every layer, less
# than TP's activations and more than DP's gradients once a step.
GRID_DIMS = ("pp", "dp", "cp", "tp")
MODEL_DIMS = ("tp", "pp", "cp")  # the degrees that cut the model's work, which a strategy spans or combines


@dataclass(frozen=True)
class Grid:
    """Degrees of data, pipeline, context and tensor parallelism; their product is the world size
    (for a one-process strategy, dp counts its replicas)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # expert-parallel degree, inside dp: not a factor of the world size

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def as_dict(self) -> dict[str, int]:
        """{"dp", "pp", "tp"}, and "cp" when the sequence is cut, "ep" when the experts are (records
        made before these existed have neither: theirs was 1)."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, **({"cp": self.cp} if self.cp > 1 else {}),
                **({"ep": self.ep} if self.ep > 1 else {})}


_ALONE = {"tp": "tensor parallelism: --strategy tp or tp-scratch alone, fsdp or ddp-scratch with --tp (2D), a "
                "library pipeline (pp-gpipe, pp-1f1b, ...) with --tp",
          "pp": "pipeline parallelism: a --strategy pp-... (pp-1f1b, pp-gpipe, ...), with --dp N for FSDP inside "
                "each stage and --tp N for tensor parallel stages",
          "cp": "context parallelism: --strategy cp-scratch alone or with --dp N, fsdp with --cp N (and --tp N), or a "
                "library pipeline (pp-1f1b, pp-gpipe, ...) with --cp N"}


def _whole(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        left_out = ", or leave it out" if allow_none else ""
        raise ConfigError(f"{name} must be a whole number >= 1 (--{name} N{left_out}), got {value!r}")


def resolve_grid(strategy: str, world_size: int, *, tp: int = 1, pp: int = 1, dp: int | None = None,
                 cp: int = 1, ep: int | None = None) -> Grid:
    """The grid `strategy` makes of `world_size` ranks with the degrees given (1 or None: not
    given; ep None: every data-parallel rank holds its own experts where the strategy cuts them),
    checked: the strategy takes every degree it is given, and they tile the world."""
    grid = _tiled(strategy, world_size, tp=tp, pp=pp, dp=dp, cp=cp)
    takes = "ep" in STRATEGY_TABLE[strategy].combines
    _whole("ep", ep, allow_none=True)
    if ep not in (None, 1) and not takes:
        experts = [name for name, s in STRATEGY_TABLE.items() if "ep" in s.combines]
        raise ConfigError(f"strategy {strategy!r} does not cut experts (ep={ep}): expert parallelism is "
                          f"--strategy {' or '.join(experts)} with a mixture-of-experts model (gpt-moe-*)")
    ep = (grid.dp if STRATEGY_TABLE[strategy].spans_experts else 1) if ep is None else ep
    if grid.dp % ep:
        fits = [d for d in range(1, grid.dp + 1) if grid.dp % d == 0]
        raise ConfigError(f"ep {ep} does not divide dp {grid.dp}: the experts are cut over ranks that are "
                          f"data-parallel ranks for the rest of the model, in groups of ep; use an ep of "
                          f"{', '.join(map(str, fits))}")
    return Grid(dp=grid.dp, pp=grid.pp, tp=grid.tp, cp=grid.cp, ep=ep)


def _tiled(strategy: str, world_size: int, *, tp: int, pp: int, dp: int | None, cp: int) -> Grid:
    if strategy not in STRATEGY_TABLE:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGY_TABLE)}")
    _whole("world_size", world_size)
    _whole("tp", tp)
    _whole("pp", pp)
    _whole("cp", cp)
    _whole("dp", dp, allow_none=True)
    info = STRATEGY_TABLE[strategy]
    given = {"tp": tp, "pp": pp, "cp": cp}
    unknown = [d for d in MODEL_DIMS if given[d] > 1 and d != info.spans and d not in info.combines]
    if unknown:
        can = ", ".join(f"--{d}" for d in info.combines) or "no other degree"
        raise ConfigError(f"strategy {strategy!r} does not combine with {' and '.join(unknown)} "
                          f"({' '.join(f'{d}={given[d]}' for d in unknown)}); it takes {can}. "
                          f"For {'; for '.join(_ALONE[d] for d in unknown)}")
    if info.spans == "none":  # one device: no grid to tile (validate asks for world_size 1)
        if dp not in (None, 1):
            raise ConfigError(f"strategy {strategy!r} runs on one device: it does not take dp={dp}")
        return Grid()
    if info.spans == "dp":
        others = tp * pp * cp
        if dp is None and world_size % others:
            named = " x ".join(f"{d} {given[d]}" for d in ("pp", "cp", "tp"))
            raise ConfigError(f"world size {world_size} is not a multiple of {named} = {others}, so no "
                              f"data-parallel degree fills it; use a world size of {others}, {2 * others}, ...")
        grid = Grid(dp=dp or world_size // others, pp=pp, tp=tp, cp=cp)
    else:  # a tensor-, pipeline- or context-parallel strategy: data parallel only where it takes dp
        kind = {"tp": "tensor", "pp": "pipeline", "cp": "context"}[info.spans]
        if dp not in (None, 1) and "dp" not in info.combines:
            raise ConfigError(f"strategy {strategy!r} is {kind} parallel only: it does not take dp={dp}")
        own = info.spans
        others = 1
        for d in MODEL_DIMS:
            others *= given[d] if d != own else 1
        degrees = dict(given)
        if given[own] == 1:  # not given: the strategy spans what the others leave
            degrees[own] = max(1, world_size // (others * (dp or 1)))
            degrees["dp"] = dp or 1
        elif dp is None and "dp" in info.combines:  # given: the ranks left are data-parallel ranks
            degrees["dp"] = max(1, world_size // (given[own] * others))
        else:
            degrees["dp"] = dp or 1
        grid = Grid(**degrees)
    if grid.size != world_size:
        cut = f"{' x cp ' + str(grid.cp) if grid.cp > 1 else ''}"
        raise ConfigError(f"world size {world_size} != dp {grid.dp} x pp {grid.pp}{cut} x tp {grid.tp} = {grid.size}; "
                          "change --world-size or the degrees")
    return grid
