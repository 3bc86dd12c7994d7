"""Writes the memory calculator's grid (multigpu.estimator.calculator) into the site's _static/ before
the pages are built, so that the chapter "Choosing a strategy" answers in the page itself.
The grid is made again only when the package's source changed (about a minute on two cores).
Sphinx copies static files only when some page is rebuilt, so a new grid marks the page that
uses it out of date: a reader who pulls a new package and runs `make book` gets its grid."""

from __future__ import annotations

from pathlib import Path

PAGE = "book/choosing"  # the page whose calculator reads the grid


def _grid_path(app) -> Path:
    return Path(app.confdir) / "_build" / "static" / "calculator-grid.js"


def _first_line(path: Path) -> str | None:
    if not path.exists():
        return None
    with path.open() as f:
        return f.readline()


def _write_grid(app) -> None:
    from multigpu.estimator import calculator

    target = _grid_path(app)
    before = _first_line(target)
    calculator.write(target)
    app.config._multigpu_grid_changed = _first_line(target) != before


def _outdated(app, env, added, changed, removed) -> list[str]:
    return [PAGE] if getattr(app.config, "_multigpu_grid_changed", False) and PAGE in env.found_docs else []


def setup(app):
    app.connect("builder-inited", _write_grid)
    app.connect("env-get-outdated", _outdated)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
