"""The exact values under every figure shown in a chapter.

A picture rounds: a reader of the site who wants a number off a bar or a line opens the table
under the figure. The values are read back from what was drawn (bars, lines and points,
labelled as in the legend, at the x the axis names), so every figure has one, whichever
function drew it. `show_values_in_notebooks()` puts the table under each figure a notebook
cell draws."""

from __future__ import annotations

import math
import re

import matplotlib.pyplot as plt

_TEX = {r"\Psi": "Ψ", r"\times": "×", r"\alpha": "α", r"\beta": "β", r"\approx": "≈", r"\cdot": "·"}


def _plain(text: str) -> str:
    """An axis label without matplotlib's $...$ mathtext (the page would show it as raw TeX)."""
    for tex, char in _TEX.items():
        text = text.replace(tex, char)
    return re.sub(r"[${}\\]", "", text).strip()


def in_words(table, words: str):
    """A chapter's table (a pandas DataFrame, rounded as it will show) with every cell that holds
    no value (NaN, None: a run not made, a quantity not measured on this machine, a plan that
    does not fit) written as `words`, which say why: a reader never sees NaN."""
    return table.astype(object).where(table.notna(), words)


def _number(value) -> str:
    value = float(value)
    if not math.isfinite(value):  # a bar or point with no measurement behind it
        return str(value)
    return f"{value:,.0f}" if value == int(value) and abs(value) < 1e15 else f"{value:,.6g}"


def _at(ax, axis: str, position: float) -> str:
    """A bar's or point's position as the axis names it: its label on an axis of named ticks
    (categories, or labels set by hand), else the number."""
    from matplotlib.category import StrCategoryFormatter
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    # categories, or labels set by hand (set_xticks(ticks, labels) installs a FuncFormatter)
    formatter = getattr(ax, f"{axis}axis").get_major_formatter()
    if isinstance(formatter, (FixedFormatter, FuncFormatter, StrCategoryFormatter)):
        # the nearest tick's: grouped bars sit beside their tick
        ticks = list(getattr(ax, f"get_{axis}ticks")())
        labels = [t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")()]
        gap = min((b - a for a, b in zip(ticks, ticks[1:])), default=1.0)
        tick, label = min(zip(ticks, labels), key=lambda t: abs(t[0] - position), default=(None, ""))
        if label and abs(tick - position) < gap / 2:
            return _plain(label)
    return _number(position)


def figure_values(fig) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(axes title, header, rows)]: per axes, every bar, labelled line and labelled point set
    as rows of (series, position, value)."""
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer

    found = []
    for ax in fig.axes:
        rows = []
        horizontal = False
        for container in ax.containers:
            if not isinstance(container, BarContainer):
                continue
            horizontal = getattr(container, "orientation", "vertical") == "horizontal"
            for patch in container.patches:
                if horizontal:
                    at, value = _at(ax, "y", patch.get_y() + patch.get_height() / 2), patch.get_width()
                else:
                    at, value = _at(ax, "x", patch.get_x() + patch.get_width() / 2), patch.get_height()
                rows.append([_plain(container.get_label() or ""), at, _number(value)])
        for line in ax.get_lines():
            label, xs, ys = line.get_label(), line.get_xdata(), line.get_ydata()
            data = line.get_transform() == ax.transData
            if label.startswith("_"):  # not in the legend: kept where it is the axes' data line
                if not data or len(xs) < 2:
                    continue
                label = ""
            if not data and len(set(map(float, ys))) == 1:
                rows.append([_plain(label), "(a level)", _number(ys[0])])  # axhline
                continue
            rows += [[_plain(label), _at(ax, "x", x), _number(y)] for x, y in zip(xs, ys)]
        for points in ax.collections:
            label = points.get_label()
            if isinstance(points, PathCollection) and not label.startswith("_"):
                rows += [[_plain(label), _at(ax, "x", x), _number(y)] for x, y in points.get_offsets()]
        if rows:
            where = _plain((ax.get_ylabel() if horizontal else ax.get_xlabel()) or "at")
            value = _plain((ax.get_xlabel() if horizontal else ax.get_ylabel()) or "value")
            found.append((_plain(ax.get_title()), ["series", where, value], rows))
    return found


def _wide(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """(series, position, value) rows as one row per position and a column per series, where
    no series has two values at one position; else as they are."""
    cells = {(series, at): value for series, at, value in rows}
    if len(cells) < len(rows):
        return header, rows
    series = list(dict.fromkeys(r[0] for r in rows))
    positions = list(dict.fromkeys(r[1] for r in rows))
    return ([header[1], *(s or header[2] for s in series)],
            [[at, *(cells.get((s, at), "") for s in series)] for at in positions])


def figure_values_html(fig) -> str:
    """The figure's values as tables in a closed <details>, or '' if it draws none."""
    from html import escape

    tables = figure_values(fig)
    if not tables:
        return ""
    parts = ['<details class="figure-values"><summary>The values in this figure</summary>']
    for title, header, rows in tables:
        unit = header[2]
        header, rows = _wide(header, rows)
        caption = ": ".join(filter(None, [title, f"values in {unit}" if unit != "value" else ""]))
        parts.append("<table>" + (f"<caption>{escape(caption)}</caption>" if caption else ""))
        parts.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append("</table>")
    return "".join(parts) + "</details>"


def _show_with_values() -> None:
    """Run after each notebook cell, before the inline backend shows the cell's figures: shows
    each, then its values, and closes it (so the backend shows it once, as it would have)."""
    from IPython.display import HTML, display

    for number in plt.get_fignums():
        fig = plt.figure(number)
        display(fig)
        html = figure_values_html(fig)
        if html:
            display(HTML(html))
        plt.close(fig)


def show_values_in_notebooks() -> None:
    """Have every figure a notebook cell draws followed by a table of its values: a chapter
    calls it once, in its first cell. It does nothing outside a notebook kernel that draws
    inline, and calling it again adds nothing."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or "inline" not in plt.get_backend():
        return
    callbacks = shell.events.callbacks["post_execute"]
    if _show_with_values not in callbacks:
        callbacks.insert(0, _show_with_values)
