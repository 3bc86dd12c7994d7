"""Writes the memory calculator's grid (multigpu.calculator) into the site's _static/ before
the pages are built, so that the chapter "Choosing a strategy" answers in the page itself.
The grid is made again only when the package's source changed (about a minute on two cores)."""

from __future__ import annotations

from pathlib import Path


def _write_grid(app) -> None:
    from multigpu import calculator

    target = Path(app.confdir) / "_build" / "static" / "calculator-grid.js"
    calculator.write(target)


def setup(app):
    app.connect("builder-inited", _write_grid)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
