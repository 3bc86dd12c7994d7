"""Keeps the memory calculator's grid (multigpu.estimator.calculator) current before the pages are built,
so that the chapter "Choosing a strategy" answers in the page itself. The grid is committed
(book/_static/calculator-grid.js, which the site's _static/ takes): it is computed again, in place, only
when the package's source files it was computed from, or torch's or transformers' versions, have changed
(minutes on two cores); commit it then (tests/test_book.py fails until it is). Sphinx copies static files
only when some page is rebuilt, so a new grid marks the page that uses it out of date."""

from __future__ import annotations

from pathlib import Path

PAGE = "book/choosing"  # the page whose calculator reads the grid


def _write_grid(app) -> None:
    from multigpu.estimator import calculator

    # builds before the grid was committed wrote it into _build/static, which the site's _static/ also
    # takes: two files of one name would collide there
    (Path(app.confdir) / "_build" / "static" / "calculator-grid.js").unlink(missing_ok=True)
    target = calculator.GRID_FILE
    before = calculator.stamp_of(target)
    calculator.write(target)
    app.config._multigpu_grid_changed = calculator.stamp_of(target) != before


def _outdated(app, env, added, changed, removed) -> list[str]:
    return [PAGE] if getattr(app.config, "_multigpu_grid_changed", False) and PAGE in env.found_docs else []


def setup(app):
    app.connect("builder-inited", _write_grid)
    app.connect("env-get-outdated", _outdated)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
