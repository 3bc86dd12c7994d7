"""The figures of chapter "Context parallelism"."""

from __future__ import annotations

from multigpu.plots.style import BLUE, GREEN, ORANGE, RED, MiB, _figure

CP_COLORS = [BLUE, ORANGE, GREEN, RED]


def activations_by_sequence(rows: list[dict], records, title="Activations per rank as the sequence grows"):
    """rows: {"seq_len", "cp", "measured", "estimated"} (bytes forward saved for backward on rank
    0): one line per cp, measured solid, the estimator's dashed."""
    fig, (ax,) = _figure(records)
    degrees = sorted({r["cp"] for r in rows})
    for i, cp in enumerate(degrees):
        mine = sorted((r for r in rows if r["cp"] == cp), key=lambda r: r["seq_len"])
        xs = [r["seq_len"] for r in mine]
        label = "one device" if cp == 1 else f"cp {cp}"
        ax.plot(xs, [r["measured"] / MiB for r in mine], "o-", color=CP_COLORS[i % 4], label=f"{label}, measured")
        ax.plot(xs, [r["estimated"] / MiB for r in mine], "x--", color=CP_COLORS[i % 4], alpha=0.7,
                label=f"{label}, estimated")
    xs = sorted({r["seq_len"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("MiB saved for backward, rank 0")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    return fig
