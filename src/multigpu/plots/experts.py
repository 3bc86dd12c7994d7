"""The figures of chapter "Mixture of experts and expert parallelism"."""

from __future__ import annotations

from multigpu.plots.style import BLUE, GREEN, ORANGE, RED, _figure

MOE_COLORS = [BLUE, ORANGE, GREEN, RED]


def busiest_expert(series: dict[str, list[float]], records, title="The busiest expert's load, step by step"):
    """One line per run (`series`: label -> moe.busiest_by_step of its record): at each step, the busiest
    expert's tokens over an even share (1: balanced), the mean over the layers."""
    fig, (ax,) = _figure(records)
    for i, (label, ratio) in enumerate(series.items()):
        ax.plot(range(len(ratio)), ratio, color=MOE_COLORS[i % 4], label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / even share (mean over layers)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def load_histogram(shares: dict[str, list[float]], records, title: str):
    """Bars: each expert's share of the (token, choice) assignments over an even share, one group of
    bars per expert, one colour per run (`shares`: label -> per-expert values)."""
    fig, (ax,) = _figure(records)
    labels = list(shares)
    experts = len(next(iter(shares.values())))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ax.bar([e + (i - (len(labels) - 1) / 2) * width for e in range(experts)], shares[label], width,
               color=MOE_COLORS[i % 4], label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(experts), [f"expert {e}" for e in range(experts)], fontsize=7)
    ax.set_ylabel("tokens routed / even share")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def dropped_vs_capacity(rows: list[dict], records, title="Tokens dropped as the capacity tightens"):
    """rows: {"capacity_factor", "first step", "mean over steps", "uniform routing", "even load"} (shares
    of the assignments dropped): the measured ones solid, the two formulas dashed."""
    fig, (ax,) = _figure(records)
    xs = [r["capacity_factor"] for r in rows]
    for key, style, color in (("first step", "o-", BLUE), ("mean over steps", "o-", ORANGE),
                              ("uniform routing", "x--", GREEN), ("even load", "x:", RED)):
        ax.plot(xs, [100 * r[key] for r in rows], style, color=color, label=key)
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("% of (token, choice) assignments dropped")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
