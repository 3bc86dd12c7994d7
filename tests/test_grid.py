"""The rank grid and the strategy table: degrees checked with their arithmetic before any
process starts; the grid's coordinates and groups against torch's own DeviceMesh; data split
by data-parallel rank."""

from __future__ import annotations

import itertools

import pytest

from multigpu import config
from multigpu.config import STRATEGY_TABLE, ConfigError, RunConfig
from multigpu.hf import write_tiny_llama_config
from multigpu.runtime import GRID_DIMS, RankGrid


def refused(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        RunConfig(**fields).validate()
    return str(info.value)


def test_degrees_that_do_not_tile_the_world_show_the_arithmetic():
    assert "world size 6 != dp 4 x pp 1 x tp 1 = 4" in refused(strategy="ddp", world_size=6, dp=4)
    assert "world size 4 != dp 1 x pp 1 x tp 2 = 2" in refused(strategy="tp", world_size=4, tp=2)
    assert "world size 3 != dp 1 x pp 1 x tp 2 = 2" in refused(strategy="tp-scratch", world_size=3, tp=2)


def test_a_strategy_refuses_degrees_it_does_not_take():
    message = refused(strategy="ddp", world_size=4, tp=2)
    assert "strategy 'ddp' does not combine with tp (tp=2)" in message
    assert "--strategy tp or tp-scratch alone, fsdp or ddp-scratch with --tp (2D)" in message
    assert "does not combine with tp and pp" in refused(strategy="zero3", world_size=8, tp=2, pp=2)
    message = refused(strategy="fsdp", world_size=8, tp=2, pp=2)  # fsdp takes tp; a pipeline takes dp
    assert "does not combine with pp (pp=2); it takes --tp" in message
    assert "a --strategy pp-... (pp-1f1b, pp-gpipe, ...), with --dp N for FSDP inside each stage" in message
    assert "does not combine with tp" in refused(strategy="pp-1f1b-scratch", world_size=4, tp=2,
                                                 grad_accum_steps=2)
    assert "world size 8 != dp 2 x pp 3 x tp 2 = 12" in refused(strategy="pp-1f1b", world_size=8, tp=2, dp=2, pp=3,
                                                                   grad_accum_steps=4, model="gpt-mini")
    assert "tensor parallel only: it does not take dp=2" in refused(strategy="tp", world_size=4, dp=2)
    assert "whole number >= 1" in refused(strategy="tp", world_size=2, tp=0)


def test_tp_that_does_not_divide_the_model_is_named():
    # gpt-tiny: 4 heads, MLP width 256, vocabulary 128
    message = refused(strategy="tp", world_size=3)
    assert "tp=3 cannot split gpt-tiny" in message
    assert "tp 3 does not divide the 4 attention heads; use a tp that divides 4" in message
    assert "the 128 vocabulary" in message
    # sequence parallelism also cuts the sequence: 2 does not divide 63
    message = refused(strategy="tp-scratch", world_size=2, seq_len=63, extra={"sequence_parallel": True})
    assert "tp 2 does not divide the 63 sequence length" in message
    RunConfig(strategy="tp-scratch", world_size=2, seq_len=63).validate()  # without SP the sequence stays whole
    assert "not T5" in refused(strategy="tp", world_size=2, model="t5-tiny")


def test_tp_checks_a_config_files_key_value_heads(tmp_path):
    path = str(write_tiny_llama_config(tmp_path / "config.json"))  # 4 query heads, 2 key/value heads
    RunConfig(strategy="tp", world_size=2, model=path).validate()
    assert "tp 4 does not divide the 2 key/value heads" in refused(strategy="tp", world_size=4, model=path)


def test_the_table_is_the_one_place_strategies_are_named():
    assert list(config.STRATEGIES) == list(STRATEGY_TABLE)
    assert config.SHARDED == [n for n, s in STRATEGY_TABLE.items() if (s.zero_stage or 0) > 0]
    for info in STRATEGY_TABLE.values():
        __import__(f"multigpu.strategies.{info.module}")  # every row names a module that exists
        assert info.description and info.shards


@pytest.mark.parametrize("strategy, world_size, tp, dp, expected", [
    ("ddp", 4, 1, None, {"dp": 4, "pp": 1, "tp": 1}),
    ("tp", 4, 1, None, {"dp": 1, "pp": 1, "tp": 4}),  # a pure strategy spans the world
    ("tp-scratch", 2, 2, None, {"dp": 1, "pp": 1, "tp": 2}),
    ("single", 1, 1, None, {"dp": 1, "pp": 1, "tp": 1}),
    ("fsdp", 8, 2, None, {"dp": 4, "pp": 1, "tp": 2}),  # 2D: fsdp spans what tp leaves
    ("ddp-scratch", 4, 2, None, {"dp": 2, "pp": 1, "tp": 2}),
    ("pp-1f1b", 4, 2, None, {"dp": 1, "pp": 2, "tp": 2}),  # a pipeline spans what tp and dp leave
    ("pp-1f1b", 4, 1, 2, {"dp": 2, "pp": 2, "tp": 1}),
    ("pp-1f1b", 8, 2, 2, {"dp": 2, "pp": 2, "tp": 2}),  # 3D
])
def test_degrees(strategy, world_size, tp, dp, expected):
    cfg = RunConfig(strategy=strategy, world_size=world_size, tp=tp, dp=dp, grad_accum_steps=2).validate()
    assert cfg.degrees == expected


def test_tp_ranks_share_their_batch():
    """Samples per data-parallel rank: under pure TP every rank gets the whole global batch."""
    cfg = RunConfig(strategy="tp", world_size=4, global_batch_size=8, grad_accum_steps=2).validate()
    assert (cfg.per_rank_batch_size, cfg.micro_batch_size) == (8, 4)


@pytest.mark.parametrize("sizes", [(2, 2, 1, 2), (1, 2, 1, 4), (4, 1, 1, 2), (2, 4, 1, 1), (1, 2, 2, 2), (2, 1, 4, 1)])
def test_grid_coordinates_put_tp_innermost(sizes):
    """Rank r = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp, as DeviceMesh lays out a
    (pp, dp, cp, tp) mesh (row-major): tp ranks are consecutive, pipeline stages the outermost blocks."""
    pp, dp, cp, tp = sizes
    world = pp * dp * cp * tp
    coords = [tuple(RankGrid({"pp": pp, "dp": dp, "cp": cp, "tp": tp}, r).coord(d) for d in GRID_DIMS)
              for r in range(world)]
    assert coords == list(itertools.product(range(pp), range(dp), range(cp), range(tp)))


def test_every_committed_run_record_states_its_grid(committed_records):
    """A record says the grid its run made, not only the degrees its config was given (`tp` on
    4 processes has tp 1 in its config: not given): the degrees tile the processes, the
    strategy's own dimension is cut, every degree given is kept, and it is the config's grid."""
    from multigpu import records

    runs = [r for path in sorted(records.RESULTS_DIR.glob("*/*.jsonl")) for r in records.read_records(path)
            if "config" in r]
    assert runs, "no committed run records"
    for record in runs:
        c, grid = record["config"], record.get("grid")
        assert grid is not None, f"a {c['strategy']} record states no grid"
        assert grid["dp"] * grid["pp"] * grid["tp"] * grid.get("cp", 1) == c["world_size"], (
            c["strategy"], c["world_size"], grid)
        spans = STRATEGY_TABLE[c["strategy"]].spans
        if spans in ("tp", "pp", "cp"):
            assert grid.get(spans, 1) > 1, (c["strategy"], grid)
        for d in ("tp", "pp", "dp", "cp"):
            if (c.get(d) or 1) > 1:
                assert grid[d] == c[d], (c["strategy"], d, grid)
        assert grid == RunConfig.from_dict(c).grid.as_dict()


def test_one_device_takes_no_degree():
    assert "strategy 'single' does not combine with tp (tp=2)" in refused(strategy="single", world_size=1, tp=2)
    assert "does not take dp=2" in refused(strategy="single", world_size=1, dp=2)
