"""The figures of chapter "Checkpoints and failures"."""

from __future__ import annotations

from multigpu.plots.style import BLUE, GREEN, ORANGE, RED, _figure

RANK_COLORS = [BLUE, ORANGE, GREEN, RED]


def checkpoint_bytes_by_rank(rows: list[dict], records, formula_bytes: float,
                             title="What each rank writes into one checkpoint"):
    """One stacked bar per layout (`rows`: {"layout", "bytes_by_rank"}), one colour per rank, beside the
    formula's whole model state (dashed)."""
    fig, (ax,) = _figure(records)
    widest = max(range(len(rows)), key=lambda i: len(rows[i]["bytes_by_rank"]))  # its ranks name the colours
    for x, row in enumerate(rows):
        bottom = 0.0
        for rank, nbytes in enumerate(row["bytes_by_rank"]):
            ax.bar(x, nbytes / 2**20, bottom=bottom, color=RANK_COLORS[rank % 4], edgecolor="white",
                   label=f"rank {rank}" if x == widest else None)
            bottom += nbytes / 2**20
    ax.axhline(formula_bytes / 2**20, color="grey", ls="--", lw=1, label="formula: weights + AdamW's two moments")
    ax.set_xticks(range(len(rows)), [r["layout"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MiB written (stacked by rank)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def save_cost(rows: list[dict], records, title="What a save costs the run"):
    """Bars per save mode (`rows`: {"mode", "blocking_s", "total_s", "step_s"}): the time training stood still
    for one save and the time the save took in all, beside one training step."""
    fig, (ax,) = _figure(records)
    xs = range(len(rows))
    width = 0.27
    for i, (key, label, color) in enumerate((("step_s", "one training step", GREEN),
                                             ("blocking_s", "training stopped, per save", RED),
                                             ("total_s", "save, start to finish", BLUE))):
        ax.bar([x + (i - 1) * width for x in xs], [1e3 * (r[key] or 0) for r in rows], width, color=color,
               label=label)
    ax.set_xticks(list(xs), [r["mode"] for r in rows])
    ax.set_ylabel("milliseconds")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
