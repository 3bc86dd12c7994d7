"""The figures of chapters "Tensor parallelism", "Pipeline parallelism" and "All together":
measurements beside their model, where tensor parallelism pays, a pipeline's timeline and its
bubble, and the grid of ranks."""

from __future__ import annotations

import matplotlib.pyplot as plt

from multigpu.plots.style import BLUE, GREEN, GREY, ORANGE, PALETTE, PURPLE, RED, _figure, style


def beside(labels: list[str], series: dict[str, list[float]], records, ylabel: str, title: str):
    """Grouped bars: for each label, one bar per series (measured beside its formula or
    model), e.g. {"measured": [...], "alpha-beta model": [...]}."""
    fig, (ax,) = _figure(records)
    palette = [BLUE, ORANGE, GREEN, GREY]
    width = 0.8 / len(series)
    pos = list(range(len(labels)))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([p + (i - (len(series) - 1) / 2) * width for p in pos], values, width, label=name, color=palette[i])
    ax.set_xticks(pos, labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def tp_speedup_by_width(widths: list[int], measured: list[float], predicted: list[float], records,
                        title="Where tensor parallelism pays: one MLP on 2 ranks against 1"):
    """Speed-up of a tensor-parallel MLP over one rank, by width: measured, and as the
    alpha-beta model of the link predicts it (half the compute plus the collectives)."""
    fig, (ax,) = _figure(records)
    ax.plot(widths, measured, "o-", color=BLUE, label="measured")
    ax.plot(widths, predicted, "s--", color=ORANGE, label="predicted: compute / 2 + alpha-beta collectives")
    ax.axhline(2, color=GREY, lw=0.8, ls=":", label="ideal (2 ranks)")
    ax.axhline(1, color=RED, lw=0.8, ls=":", label="break-even")
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("width h of the MLP (h -> 4h -> h)")
    ax.set_ylabel("speed-up over one rank")
    ax.set_ylim(0, 2.3)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return fig


ACTION_COLORS = {"F": BLUE, "B": ORANGE, "W": GREEN}


def _timeline_clock(records) -> str:
    """What a pipeline timeline's times are, for its axis: nothing to add on a CPU (the host is
    the device); on a GPU the GPU's time only where every rank's log says it used CUDA events
    (the report's "clock"), else the host's, which saw kernels queued, not run."""
    if all(r.get("provenance", {}).get("device_type") != "cuda" for r in records):
        return ""
    clocks = {x.get("clock") for r in records for x in r.get("strategy_report_by_rank") or [r]}
    return " (GPU time: CUDA events)" if clocks == {"cuda-events"} else " (host clock: kernels queued, not GPU time)"


def pipeline_timeline(events_by_rank: list[list[dict]], starts_unix: list[float], records, title: str, ax=None):
    """One row per rank, one box per action (F forward, B backward, W weight gradient),
    labelled with its micro-batch; the gaps are the bubble. Ranks are lined up on the wall
    clock of their step's start (one machine: one clock). A rank holding two stages shows
    the second stage's boxes hatched."""
    if ax is None:
        fig, (ax,) = _figure(records, height=0.55 * len(events_by_rank) + 1.6)
    else:
        fig = ax.figure
    t0 = min(starts_unix)
    first_stage = [min((e["stage"] for e in events), default=0) for events in events_by_rank]
    for rank, (events, start) in enumerate(zip(events_by_rank, starts_unix)):
        for e in events:
            if e["action"] not in ACTION_COLORS:
                continue  # communication boxes: shown as gaps, the time a stage waits
            left = (start - t0 + e["start_s"]) * 1e3
            width = (e["end_s"] - e["start_s"]) * 1e3
            ax.barh(rank, width, left=left, height=0.8, color=ACTION_COLORS[e["action"]], edgecolor="white",
                    hatch="//" if e["stage"] != first_stage[rank] else None, linewidth=0.5)
            if width > 0:
                ax.text(left + width / 2, rank, str(e["micro"]), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(events_by_rank)), [f"rank {r}" for r in range(len(events_by_rank))])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms from the step's start{_timeline_clock(records)}")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ACTION_COLORS.values()]
    ax.legend(handles, ["forward", "backward", "weight gradient"], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.22), ncols=3)
    return fig


def bubble_vs_formula(rows: list[dict], formulas: dict, records, title="The bubble: measured against the formula"):
    """Measured bubble fraction (1 - ideal / step) against m, one line per schedule and p,
    with the formula's curve dashed. `formulas`: label -> function (p, m) -> fraction."""
    fig, axes = _figure(records, ncols=2, width=8.4, height=3.6)
    palette = [BLUE, ORANGE, GREEN, RED, PURPLE, GREY]
    for ax, p in zip(axes, (2, 4)):
        mine = [r for r in rows if r["p"] == p]
        for i, schedule in enumerate(dict.fromkeys(r["schedule"] for r in mine)):
            pts = sorted((r["m"], 1 - r["ideal_s"] / r["step_s"]) for r in mine if r["schedule"] == schedule)
            ax.plot(*zip(*pts), "o-", color=palette[i % len(palette)], label=schedule, ms=4)
        ms = sorted({r["m"] for r in mine})
        for j, (label, f) in enumerate(formulas.items()):
            ax.plot(ms, [f(p, m) for m in ms], ls="--", color="k", alpha=0.7 - 0.3 * j, lw=1, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches m")
        ax.set_title(f"p = {p} stages", fontsize=9)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("bubble: idle share of the step")
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    return fig


def rank_grid(sizes: dict[str, int], title="The rank grid: pp x dp x tp"):
    """A diagram of `runtime.RankGrid`: one panel per pipeline stage, each a dp x tp table
    of ranks (tp innermost: a row is one tensor-parallel group of consecutive ranks, a
    column one data-parallel group; the same cell in every panel is one pipeline). Drawn
    from the grid's own coordinates, not by hand."""
    from matplotlib.patches import Rectangle

    from multigpu.runtime import RankGrid

    style()
    pp, dp, tp = (sizes[d] for d in ("pp", "dp", "tp"))  # drawn without cp: one more axis would need 3-D
    fig, axes = plt.subplots(1, pp, figsize=(2.2 * pp * max(1, tp / 2) + 0.6, 0.9 * dp + 1.2),
                             constrained_layout=True, squeeze=False)
    for rank in range(pp * dp * tp):
        grid = RankGrid(sizes, rank)
        s, d, t = (grid.coord(dim) for dim in ("pp", "dp", "tp"))
        ax = axes[0][s]
        ax.add_patch(Rectangle((t, dp - 1 - d), 0.92, 0.88, color=PALETTE[s % len(PALETTE)], alpha=0.85))
        ax.text(t + 0.46, dp - 1 - d + 0.44, f"rank {rank}\n(dp {d}, tp {t})", ha="center", va="center",
                color="white", fontsize=8)
    for s, ax in enumerate(axes[0]):
        ax.set_xlim(-0.1, tp + 0.05)
        ax.set_ylim(-0.1, dp + 0.05)
        ax.set_xticks([i + 0.46 for i in range(tp)], [f"tp {i}" for i in range(tp)], fontsize=8)
        ax.set_yticks([dp - 1 - i + 0.44 for i in range(dp)], [f"dp {i}" for i in range(dp)], fontsize=8)
        ax.grid(False)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_title(f"pipeline stage {s}", fontsize=9)
    fig.suptitle(f"{title} = {pp} x {dp} x {tp}\na row is a TP group, a column a DP group, "
                 "the same cell across the panels a pipeline", fontsize=9)
    return fig


# -- the exact values under every figure shown in a chapter ---------------------------------
# A picture rounds: a reader of the site who wants a number off a bar or a line opens the
# table under the figure. The values are read back from what was drawn (bars, lines and
# points, labelled as in the legend, at the x the axis names), so every figure has one,
