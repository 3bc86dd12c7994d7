"""The look every figure shares: one palette, the colours that mean the same thing in every
chapter (a memory category, a strategy), and the frame of a figure drawn from records, whose
footer says where its numbers come from."""

from __future__ import annotations

import matplotlib.pyplot as plt

from multigpu.records import caption
from multigpu.strategy_table import STRATEGY_TABLE

MiB = 2**20

# The one palette: seaborn's "deep" colours, in their order, for anything told apart by colour.
PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
BLUE, ORANGE, GREEN, RED, PURPLE, BROWN, PINK, GREY = PALETTE
# and the greys of text, backgrounds and of what is not one of the things told apart
INK = "#222222"  # dark text on a light cell
DARK = "#333333"  # a bar that is the reference: one device, DDP's step
MUTED = "#555555"  # footers
FAINT = "#777777"  # a remark inside a figure
SUM_GREY = "#BBBBBB"  # a value summed over ranks
LIGHT = "#CCCCCC"  # what is left of a step
PALE = "#DDDDDD"  # nothing fits
BACKGROUND = "#EEEEEE"  # an empty lane

COLORS = {"params": BLUE, "grads": ORANGE, "optimizer": GREEN, "activations": RED, "other": GREY}
# A strategy's colour, read off the strategy table so that a new row is drawn too: the
# reference (one device, which spans nothing) dark, the others the palette in the table's
# order (ddp blue, ddp-scratch orange, ...).
_COMPARED = [name for name, s in STRATEGY_TABLE.items() if s.spans != "none"]
STRATEGY_COLORS = {name: DARK if s.spans == "none" else PALETTE[_COMPARED.index(name) % len(PALETTE)]
                   for name, s in STRATEGY_TABLE.items()}


def style() -> None:
    plt.rcParams.update({"figure.dpi": 110, "axes.spines.top": False, "axes.spines.right": False,
                         "axes.grid": True, "grid.alpha": 0.3, "font.size": 10, "legend.frameon": False})


def _footer(fig, text: str, y: float = -0.02, wrap: bool = False) -> None:
    """The line under a figure that says where its numbers come from."""
    fig.text(0.5, y, text, ha="center", va="top", fontsize=7.5, color=MUTED, wrap=wrap)


def _live_footer(fig, processes: int, y: float) -> None:
    """The footer of a figure run live while the book was built: where it ran."""
    import torch

    from multigpu.records import cpu_name

    _footer(fig, f"Run live while this page was built: {processes} gloo processes on {cpu_name()}, "
                 f"torch {torch.__version__}.", y)


def _stacked_bars(ax, x, series: dict, colors) -> None:
    """One stacked bar at each x: `series` maps a legend label to one value per x, bottom
    first; `colors`, one colour per series, in the same order."""
    bottoms = [0.0] * len(x)
    for (label, values), color in zip(series.items(), colors):
        ax.bar(x, values, bottom=bottoms, label=label, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]


def _figure(records, ncols=1, width=6.4, height=3.6):
    """A figure of `ncols` axes in a row, in the book's style, captioned by the records it shows."""
    style()
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), constrained_layout=True, squeeze=False)
    fig.get_layout_engine().set(h_pad=0.12)
    _footer(fig, caption(records), wrap=True)  # a caption can be longer than the figure is wide
    return fig, list(axes[0])
