"""The figures of chapter "Choosing": what the estimator predicts (nothing ran, so the footer
says so instead of naming a machine), and the estimator against every recorded run."""

from __future__ import annotations

import matplotlib.pyplot as plt

from multigpu.memory import CATEGORIES
from multigpu.plots.style import COLORS, MiB, _figure, _footer, _stacked_bars, style

ESTIMATED_FOOTER = "estimated by multigpu.estimator: ZeRO formulas and activations traced on fake tensors; nothing ran"


def _estimated_figure(width=6.4, height=3.6):
    style()
    fig, ax = plt.subplots(figsize=(width, height), constrained_layout=True)
    fig.get_layout_engine().set(h_pad=0.12)
    _footer(fig, ESTIMATED_FOOTER)
    return fig, ax


def estimate_bars(per_rank: dict, memory_bytes: int | None = None, title="Estimated memory per GPU at the peak"):
    """per_rank: label -> {category: bytes}; a stacked bar per label, and the device's memory."""
    fig, ax = _estimated_figure(width=max(5.0, 1.1 * len(per_rank) + 2.5))
    labels = list(per_rank)
    _stacked_bars(ax, labels, {cat: [per_rank[k][cat] / 2**30 for k in labels] for cat in CATEGORIES},
                  [COLORS[cat] for cat in CATEGORIES])
    if memory_bytes:
        ax.axhline(memory_bytes / 2**30, color="black", lw=1, ls="--", label="device memory")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7, ncol=3)
    return fig


def predicted_vs_measured(rows, records, title="The estimator against every recorded run"):
    """rows: multigpu.estimator.accuracy.against_records; measured peak total against the estimate."""
    fig, (ax,) = _figure(records)
    for strategy in sorted({r["strategy"] for r in rows}):
        mine = [r for r in rows if r["strategy"] == strategy]
        ax.scatter([r["measured"]["total"] / MiB for r in mine], [r["estimated"]["total"] / MiB for r in mine],
                   s=18, label=strategy)
    top = max(max(r["measured"]["total"], r["estimated"]["total"]) for r in rows) / MiB * 1.05
    ax.plot([0, top], [0, top], color="black", lw=0.8, label="estimate = measurement")
    ax.set_xlabel("measured peak, rank 0 (MiB)")
    ax.set_ylabel("estimated peak (MiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    return fig

