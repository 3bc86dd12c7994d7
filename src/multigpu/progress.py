"""A run's progress, from the line rank 0 prints after each step to what the launcher draws of
it: a bar in a terminal, or in a notebook that draws figures in the cell, a live figure of the
loss, the step time and the step's peak memory.

Both sides import this module: the training loop (in the workers) for the mark it prints, the
launcher for the views. It imports neither, and matplotlib only when a live figure is drawn.
"""

from __future__ import annotations

import sys
import time

# rank 0 prints one line per step: the mark, steps done, steps, loss, step time (s), the step's
# peak as the machine counts it (ProcessPeaks, bytes; -1 unknown); the launcher draws a bar, or in
# a notebook a live figure
PROGRESS_MARK = "@@multigpu-progress"


def progress_view(bar: tuple[int, str]):
    """A live figure for training steps in a notebook that draws figures in the cell; a bar
    otherwise (a terminal, or a run without steps: spmd's functions). `bar`: (steps, title).
    The launcher feeds it the fields after PROGRESS_MARK (`update(*fields)`), then `close()`s it."""
    return _Live(bar) if bar[0] > 0 and _draws_inline() else _Bar(bar)


def _draws_inline() -> bool:
    """A notebook kernel whose figures appear in the cell (matplotlib's inline backend)."""
    if "ipykernel" not in sys.modules:
        return False
    import matplotlib

    return "inline" in matplotlib.get_backend()


class _Bar:
    """Progress as a bar (tqdm: a terminal, or a notebook's widget) with the loss beside it."""

    def __init__(self, bar: tuple[int, str]):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=bar[0], desc=bar[1], unit="step", leave=False)

    def update(self, done: str, total: str | None = None, loss: str | None = None, *_more: str) -> None:
        self.bar.n = int(done)
        self.bar.set_postfix(loss=float(loss) if loss is not None else None, refresh=True)

    def close(self) -> None:
        self.bar.close()


class _Live:
    """A training run in a notebook that draws inline: LiveRun, fed by rank 0's lines."""

    def __init__(self, bar: tuple[int, str]):
        self.figure = LiveRun(*bar)

    def update(self, done: str, total: str, loss: str, step_s: str = "nan", peak: str = "-1", *_more: str) -> None:
        self.figure.update(int(done), float(loss), float(step_s), float(peak))

    def close(self) -> None:
        self.figure.close()


class LiveRun:
    """A run started from a notebook: its loss, step time and each step's peak memory on rank 0,
    drawn as each step arrives (at most twice a second), left in the cell when it ends."""

    def __init__(self, steps: int, title: str, redraw_s: float = 0.5):
        import matplotlib.pyplot as plt
        from IPython.display import display

        from multigpu.plots.style import PALETTE, style

        style()
        self.steps, self.title, self.redraw_s = steps, title, redraw_s
        self.colors = PALETTE[:3]  # loss, step time, peak
        self.rows: list[tuple[int, float, float, float | None]] = []
        self.fig, self.axes = plt.subplots(1, 3, figsize=(9, 2.4), constrained_layout=True)
        self.drawn_at = 0.0
        self._draw()
        self.handle = display(self.fig, display_id=True)

    def update(self, done: int, loss: float, step_s: float, peak_bytes: float | None) -> None:
        self.rows.append((done, loss, step_s * 1e3, None if peak_bytes is None or peak_bytes < 0
                          else peak_bytes / 2**30))
        if time.monotonic() - self.drawn_at >= self.redraw_s or done == self.steps:
            self._draw()
            self.handle.update(self.fig)

    def _draw(self) -> None:
        self.drawn_at = time.monotonic()
        steps = [r[0] for r in self.rows]
        labels = ("loss (rank 0's samples)", "step time (ms)", "the step's peak (GiB)")
        for ax, i, label in zip(self.axes, (1, 2, 3), labels):
            ax.clear()
            points = [(s, r[i]) for s, r in zip(steps, self.rows) if r[i] is not None]
            if points:
                ax.plot(*zip(*points), color=self.colors[i - 1], marker="." if len(points) < 30 else None)
            ax.set_xlim(0.5, max(self.steps, 1) + 0.5)
            ax.set_xlabel("step")
            ax.set_title(label, fontsize=9)
        done = steps[-1] if steps else 0
        self.fig.suptitle(f"{self.title}: step {done} of {self.steps} (memory: rank 0's process above its size "
                          "before the model, as the machine counts it)", fontsize=9)

    def close(self) -> None:
        """The last state stays in the cell; the figure is closed so it is not shown twice."""
        import matplotlib.pyplot as plt

        self._draw()
        self.handle.update(self.fig)
        plt.close(self.fig)
