"""The figures of chapter "One device": what a step's peak memory is made of, and how it
grows with the batch or the sequence."""

from __future__ import annotations

from multigpu.memory import CATEGORIES
from multigpu.plots.style import COLORS, MiB, _figure, _stacked_bars


def memory_stacked(records, labels, title="Peak memory of rank 0, by category"):
    """One stacked bar per record: the categories alive at the moment of the peak."""
    fig, (ax,) = _figure(records)
    _stacked_bars(ax, labels, {cat: [r["peak_memory_bytes_by_rank"][0][cat] / MiB for r in records]
                               for cat in CATEGORIES}, [COLORS[cat] for cat in CATEGORIES])
    ax.set_ylabel("MiB at the peak")
    ax.set_title(title)
    ax.legend(ncols=len(CATEGORIES), fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.12))
    return fig


def memory_growth(records, x_of, xlabel, title):
    """Saved activations and the peak, as a batch or sequence dimension grows."""
    fig, (ax,) = _figure(records)
    rows = sorted(records, key=x_of)
    xs = [x_of(r) for r in rows]
    model_states = [sum(r["model_state_bytes_by_rank"][0].values()) / MiB for r in rows]
    ax.plot(xs, [r["saved_activation_bytes_by_rank"][0] / MiB for r in rows], "o-", color=COLORS["activations"],
            label="activations saved by forward")
    ax.plot(xs, model_states, "o-", color=COLORS["params"], label="model states (params + grads + optimizer)")
    ax.plot(xs, [r["peak_memory_bytes_by_rank"][0]["total"] / MiB for r in rows], "k--", label="peak total")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend()
    return fig
