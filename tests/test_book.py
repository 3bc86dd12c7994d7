"""The book's structure and its committed records (the build itself is `make book`).

Every chapter in _toc.yml exists as a MyST notebook; every experiment a chapter loads is
one that `make figures` runs, and has committed records with the schema chapters read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from multigpu import records
from multigpu.experiments import EXPERIMENTS, Job
from multigpu.memory import CATEGORIES

ROOT = Path(__file__).resolve().parents[1]


def chapters() -> list[Path]:
    """The introduction and the chapters: every page of the table of contents but the appendix."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for part in toc["parts"] if part["caption"] != "Appendix"
                             for c in part["chapters"]]
    return [ROOT / f"{f}.md" for f in files]


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_chapter_is_a_myst_notebook(chapter):
    text = chapter.read_text()
    assert text.startswith("---\njupytext:"), f"{chapter} lacks the jupytext header"
    assert "format_name: myst" in text
    assert "```{code-cell} ipython3" in text, f"{chapter} has no code cell"


def loaded_experiments() -> set[str]:
    names = set()
    for chapter in chapters():
        names |= set(re.findall(r'records\.load\("([a-z_]+)"\)', chapter.read_text()))
    return names


def test_chapters_load_only_experiments_that_make_figures_runs():
    assert loaded_experiments(), "no chapter loads records"
    assert loaded_experiments() <= set(EXPERIMENTS)


REQUIRED = {"config", "step_time_s", "tokens_per_s", "loss", "peak_memory_bytes_by_rank",
            "comm_bytes_per_step_by_rank", "provenance", "saved_activation_bytes_by_rank",
            "model_state_bytes_by_rank", "parameters"}


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_committed_records_have_the_schema(experiment):
    tags = records.machines_with(experiment)
    assert tags, f"no committed records of {experiment}: run `make figures` and commit results/"
    if any(isinstance(item, Job) for item in EXPERIMENTS[experiment]()):  # measurements, not runs
        for tag in tags:
            runs = records.load(experiment, tag)
            assert runs and all({"provenance", "experiment"} <= r.keys() for r in runs)
            assert all(r["provenance"]["machine_tag"] == tag for r in runs)
        return
    for tag in tags:
        runs = records.load(experiment, tag)
        assert len(runs) == len(EXPERIMENTS[experiment]()) or not tag.startswith("cpu-"), (
            f"{tag}/{experiment}.jsonl has {len(runs)} records, the experiment has "
            f"{len(EXPERIMENTS[experiment]())} runs")
        for run in runs:
            assert REQUIRED <= run.keys()
            world_size = run["config"]["world_size"]
            assert len(run["peak_memory_bytes_by_rank"]) == world_size
            assert all(set(m) == {*CATEGORIES, "total"} for m in run["peak_memory_bytes_by_rank"])
            assert len(run["loss"]) == run["config"]["steps"]
            assert run["provenance"]["machine_tag"] == tag
            assert run["provenance"]["world_size"] == world_size


# -- exercises -------------------------------------------------------------------------------

EXERCISE = re.compile(r"^\*\*Exercise (\d+)[^*]*\.\*\*", re.M)
ANSWER = re.compile(r"^:::\{dropdown\} Answer\n(.*?)^:::$", re.M | re.S)
COMPUTED = re.compile(r"\{glue(?::text)?\}`[^`]*`|``[^`]*``|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$", re.S)
TYPED = re.compile(r"(?<![A-Za-z_\d.-])\d+(?:\.\d+)?(?![A-Za-z])")  # not in a name: fp16, ZeRO-3, 1F1B, 3D
# "= 12" or "\approx 3.5" in a formula: a typed result (a formula's constants, 2(N-1)/N, are fine)
TYPED_IN_MATH = re.compile(r"(?:=|\\approx)\s*-?\d[\d.,]*\s*(?:\$|\\,|\\text|[^\w(^{\\])")


def exercises(chapter: Path) -> tuple[list[str], list[str]]:
    """(the exercises' numbers, the answers' text) of the chapter's "## Exercises" section."""
    text = chapter.read_text()
    start = text.find("\n## Exercises\n")
    if start < 0:
        return [], []
    section = text[start:]
    end = re.search(r"^## (?!Exercises)", section, re.M)
    section = section[: end.start()] if end else section
    return EXERCISE.findall(section), ANSWER.findall(section)


@pytest.mark.parametrize("chapter", chapters()[1:], ids=lambda p: p.stem)  # all but the introduction
def test_every_chapter_ends_with_exercises_whose_answers_are_computed(chapter):
    numbers, answers = exercises(chapter)
    assert len(numbers) >= 3, f"{chapter.stem}: {len(numbers)} exercises (at least 3 under '## Exercises')"
    assert numbers == [str(i) for i in range(1, len(numbers) + 1)], f"{chapter.stem}: numbered {numbers}"
    assert len(answers) == len(numbers), f"{chapter.stem}: {len(numbers)} exercises, {len(answers)} answers"
    later = chapter.read_text().split("\n## Exercises\n", 1)[1]
    assert not re.search(r"^## (?!References)", later, re.M), f"{chapter.stem}: Exercises is not the last section"
    for i, answer in enumerate(answers, 1):
        assert re.search(r"\{glue(?::text)?\}`ex_", answer), (
            f"{chapter.stem}, exercise {i}: the answer glues nothing from its cell (glue names start with ex_)")
        bare = COMPUTED.sub(" ", answer)
        typed = [m.group() for m in TYPED.finditer(bare)]
        assert not typed, f"{chapter.stem}, exercise {i}: a number typed in the answer: {bare.strip()[:200]!r}"
        maths = re.findall(r"\$\$.*?\$\$|\$[^$]*\$", answer, re.S)
        assert not [m for m in maths if TYPED_IN_MATH.search(m)], (
            f"{chapter.stem}, exercise {i}: a typed result in a formula: {maths}")


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_first_code_cell_says_how_to_install_the_package_when_the_kernel_lacks_it(chapter):
    """A chapter opened in someone else's kernel says, in one line, what to install; it never
    pip-installs by itself."""
    first = chapter.read_text().split("```{code-cell} ipython3\n", 1)[1].split("\n```", 1)[0]
    assert first.startswith(":tags: [remove-cell]\n"), f"{chapter.stem}: the first cell is not the install check"
    assert 'find_spec(m) is None]' in first and '%pip install -e \\"..[chapters]\\"' in first, first
    assert "subprocess" not in first and not re.search(r"^\s*%pip", first, re.M)


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_every_glued_name_the_prose_uses_is_glued_by_the_chapter(chapter):
    """A `{glue:text}` name with no `glue("name", ...)` in the chapter fails `make book` (-W) after minutes of
    execution; this finds most such slips in a second (an f-string's placeholders match any text, so a name an
    f-string could make passes here; `make book` remains the whole check)."""
    text = chapter.read_text()
    names = [re.compile("^" + re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(name)) + "$") if f else re.compile(
        "^" + re.escape(name) + "$") for f, _, name in re.findall(r"glue\(\s*(f?)([\"'])(.+?)\2", text)]
    used = set(re.findall(r"\{glue(?::[a-z]+)?\}`([^`:]+)", text))
    assert not [u for u in used if not any(n.match(u) for n in names)], sorted(
        u for u in used if not any(n.match(u) for n in names))


@pytest.mark.parametrize("chapter", [c for c in chapters() if c.stem != "intro"], ids=lambda p: p.stem)
def test_the_setup_cell_is_folded_in_the_html(chapter):
    """The cell after the install check sets the chapter up (imports, shared values): the page folds it
    behind a toggle (hide-input), so that the chapter opens on its text and figures; the notebook keeps it."""
    second = chapter.read_text().split("```{code-cell} ipython3\n", 2)[2].split("\n```", 1)[0]
    assert second.startswith(":tags: [hide-input]\n"), f"{chapter.stem}: the setup cell is shown whole"
    assert re.search(r"^(import|from) ", second, re.M), f"{chapter.stem}: the second cell is not the setup"


CODE_WIDTH = 79  # PEP 8's line; multigpu.css sets code at a size that shows it whole at 1280 px


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_code_lines_fit_the_page_without_scrolling(chapter):
    """Every line of every code cell is at most CODE_WIDTH characters, so that no code block of the
    site scrolls sideways (tests/test_site.py checks the built pages themselves)."""
    cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```$", chapter.read_text(), re.M | re.S)
    long = [line for cell in cells for line in cell.splitlines() if len(line) > CODE_WIDTH]
    assert cells and not long, f"{chapter.stem}: {len(long)} code lines over {CODE_WIDTH}: {long[:3]}"


def test_the_glossary_names_what_exists_and_links_every_chapter():
    """Every package name in the glossary is real (a strategy, a flag of `run`, a Python name),
    every chapter is linked from it, and every term has its Korean."""
    import importlib

    from multigpu.__main__ import build_parser
    from multigpu.config import STRATEGIES

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    assert {"file": "book/glossary"} in toc["parts"][-1]["chapters"] and toc["parts"][-1]["caption"] == "Appendix"
    text = (ROOT / "book" / "glossary.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| term")]
    assert len(rows) > 50
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # argparse keeps its subcommands there
    flags = {flag for action in run._actions for flag in action.option_strings}
    assert "--tp" in flags
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and all(cells), row
        assert re.search(r"[\uac00-\ud7a3]", cells[1]) or cells[1] == cells[0], f"no Korean for {cells[0]}"
        for name in re.findall(r"`([^`]+)`", cells[3]):
            if name.startswith("--strategy "):
                assert name.split()[1] in STRATEGIES, name
            elif name.startswith("--"):
                assert name.split()[0] in flags, name
            else:
                module, _, attr = name.rpartition(".")
                try:
                    found = importlib.import_module(name)
                except ModuleNotFoundError:
                    found = getattr(importlib.import_module(module), attr, None)
                assert found is not None, f"{name} (glossary, {cells[0]}) does not exist"
    linked = set(re.findall(r"\{doc\}`([a-z_]+)`", text))
    assert linked == {c.stem for c in chapters()[1:]}, linked ^ {c.stem for c in chapters()[1:]}


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_last_cell_says_where_and_with_what_the_chapter_was_executed(chapter):
    last = chapter.read_text().rsplit("```{code-cell} ipython3\n", 1)[1]
    assert last.startswith(":tags: [remove-input]\n") and "executed_here()" in last, chapter.stem


def test_executed_here_names_the_machine_and_versions():
    import platform

    import torch

    line = records.executed_here()
    assert records.machine_tag() in line and torch.__version__ in line and platform.python_version() in line


def test_the_committed_calculator_grid_is_current():
    """The calculator's grid is committed (computing it takes minutes, CI's clean clone would pay them every
    time): it must be the one the package's current source computes, and a grid that `make book` computed
    again must be committed, else every clean clone computes it again."""
    import subprocess

    from multigpu.estimator.calculator import GRID_FILE, is_current

    rebuild = "run `.venv/bin/python -m multigpu.estimator.calculator` (minutes) and commit it"
    name = GRID_FILE.relative_to(ROOT)
    assert is_current(GRID_FILE), f"{name} is older than the source it was computed from: {rebuild}"
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(GRID_FILE)], cwd=ROOT, capture_output=True)
    if b"not a git repository" in tracked.stderr:
        pytest.skip("not a git checkout: whether the grid is committed cannot be asked")
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(GRID_FILE)], cwd=ROOT, capture_output=True)
    assert tracked.returncode == 0 and changed.returncode == 0, f"{name} was computed again, not committed: commit it"
