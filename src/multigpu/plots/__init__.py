"""Every figure of the book, as a function of records.

Each function takes records (from `multigpu.records.load`) and returns a matplotlib Figure
whose footer names the machine, backend, devices and date that produced them.

- `style`: the palette, the colours that mean one thing throughout (memory categories,
  strategies) and the frame every figure is drawn in;
- one module per chapter group: `one_device`, `data_parallel` (DDP and DataParallel),
  `collectives`, `sharding` (ZeRO and FSDP), `model_parallel` (TP, PP and all together),
  `context_parallel`, `experts` (mixtures of experts), `checkpoints`, `limits` (Time against the
  limit) and `estimates` (Choosing);
- `values`: the exact values under each figure, which a chapter shows by calling
  `show_values_in_notebooks()` in its first cell.

The chapters call every figure from here: `from multigpu import plots; plots.scaling(runs)`.
"""

from multigpu.plots.checkpoints import checkpoint_bytes_by_rank, save_cost
from multigpu.plots.collectives import bytes_per_rank, collective_bandwidth, collective_grid, staleness
from multigpu.plots.context_parallel import activations_by_sequence
from multigpu.plots.data_parallel import (
    DP_PHASES,
    buckets,
    comm_vs_rule,
    dp_memory,
    dp_phases,
    dp_threads,
    loss_curves,
    max_batch,
    scaling,
)
from multigpu.plots.estimates import estimate_bars, predicted_vs_measured
from multigpu.plots.experts import busiest_expert, dropped_vs_capacity, load_histogram
from multigpu.plots.limits import matmul_sweep, mfu_bars, recompute_bars, step_breakdown, step_timelines
from multigpu.plots.model_parallel import beside, bubble_vs_formula, pipeline_timeline, rank_grid, tp_speedup_by_width
from multigpu.plots.one_device import memory_growth, memory_stacked
from multigpu.plots.sharding import (
    animation_html,
    comm_by_strategy,
    model_states_vs_formula,
    zero_stages,
    zero_timeline,
)
from multigpu.plots.style import COLORS, PALETTE, STRATEGY_COLORS  # not style(), which would hide the module
from multigpu.plots.values import figure_values, figure_values_html, in_words, show_values_in_notebooks

__all__ = ["COLORS", "DP_PHASES", "PALETTE", "STRATEGY_COLORS", "activations_by_sequence", "animation_html",
           "beside", "bubble_vs_formula", "buckets", "busiest_expert", "bytes_per_rank", "checkpoint_bytes_by_rank",
           "collective_bandwidth", "collective_grid", "comm_by_strategy", "comm_vs_rule", "dp_memory", "dp_phases",
           "dp_threads", "dropped_vs_capacity", "estimate_bars", "figure_values", "figure_values_html",
           "in_words", "load_histogram", "loss_curves", "matmul_sweep", "max_batch", "memory_growth", "memory_stacked",
           "mfu_bars", "model_states_vs_formula", "pipeline_timeline", "predicted_vs_measured", "rank_grid",
           "recompute_bars", "save_cost", "scaling", "show_values_in_notebooks", "staleness", "step_breakdown",
           "step_timelines", "tp_speedup_by_width", "zero_stages", "zero_timeline"]
