"""The built site as a reader opens it: every page of _build/html in headless Chromium, from
disk, with the network cut off (every request that is not a file is refused and reported).

Checked on every page: no error in the browser's console, no request for the network, every
image loaded, every formula typeset by MathJax (no raw \\( left in the text), every internal
link and anchor resolves; and the search page finds a chapter by a word in it. A screenshot
of each page goes to _build/screenshots/ for review.

The site must be built first (`make book`); Chromium is Debian's (`apt install chromium`),
driven by Playwright. Where either is missing the tests are skipped and say why, except in
CI, where .ci/run installs Chromium, builds the site first and sets MULTIGPU_REQUIRE_SITE=1,
so that a skip there is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"
REQUIRED = os.environ.get("MULTIGPU_REQUIRE_SITE") == "1"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def need(ok, reason: str) -> None:
    if not ok:
        (pytest.fail if REQUIRED else pytest.skip)(reason)


def pages() -> list[Path]:
    """Every page of the table of contents, as built."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for part in toc["parts"] for c in part["chapters"]]
    return [SITE / f"{f}.html" for f in files]


@dataclass
class Visit:
    page: Path
    console_errors: list[str] = field(default_factory=list)
    network: list[str] = field(default_factory=list)
    broken_images: list[str] = field(default_factory=list)
    raw_math: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)


VISIT_JS = """async () => {
  if (window.MathJax && MathJax.startup) { await MathJax.startup.promise; }
  window.scrollTo(0, document.body.scrollHeight);
  await Promise.all([...document.images].map(i => i.complete ? null :
      new Promise(done => { i.onload = i.onerror = done; setTimeout(done, 5000); })));
  const main = (document.querySelector('main') || document.body).cloneNode(true);
  main.querySelectorAll('pre, code, script, style, textarea').forEach(e => e.remove());
  const text = main.textContent;
  const raw = [];
  for (const marker of ['\\\\(', '\\\\[', '$$']) {
    const at = text.indexOf(marker);
    if (at >= 0) raw.push(text.slice(Math.max(0, at - 40), at + 60).replace(/\\s+/g, ' '));
  }
  const dollars = text.match(/\\$[^$\\s][^$\\n]{0,80}\\$/);  // $x$ left as text (in a glued string, say)
  if (dollars) raw.push(dollars[0]);
  return {
    broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
    raw: raw,
    untypeset: document.querySelectorAll('.math:not(:has(mjx-container))').length,
    links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  };
}"""


@pytest.fixture(scope="module")
def browser():
    need((SITE / "index.html").exists(), f"the site is not built ({SITE}): run `make book` first")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    need(chromium, "Chromium is not installed (Debian: apt install chromium); .ci/run installs it in CI")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        need(False, "playwright is not installed: make install (requirements.txt pins it)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def open_page(browser, url: str, network: list[str], console: list[str]):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"uncaught: {e}"))

    def offline(route):
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            network.append(route.request.url)
            route.abort()

    page.route("**/*", offline)
    page.goto(url, wait_until="load")
    return page


@pytest.fixture(scope="module")
def visits(browser) -> list[Visit]:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    found = []
    for path in pages():
        assert path.exists(), f"{path} was not built"
        visit = Visit(path)
        page = open_page(browser, path.as_uri(), visit.network, visit.console_errors)
        page.screenshot(path=str(SCREENSHOTS / f"{path.stem}.png"))
        seen = page.evaluate(VISIT_JS)
        visit.broken_images = seen["broken"]
        visit.raw_math = seen["raw"] + [f"{seen['untypeset']} formula(s) not typeset"] * bool(seen["untypeset"])
        visit.links, visit.ids = seen["links"], set(seen["ids"])
        page.close()
        found.append(visit)
    return found


def problems(visits: list[Visit], attribute: str) -> dict[str, list]:
    return {v.page.stem: getattr(v, attribute) for v in visits if getattr(v, attribute)}


def test_no_console_errors(visits):
    assert not problems(visits, "console_errors")


def test_no_page_asks_the_network(visits):
    assert not problems(visits, "network"), "a page needs the network to render (served offline, it must not)"


def test_every_image_loads(visits):
    assert not problems(visits, "broken_images")


def test_every_formula_is_typeset(visits):
    assert not problems(visits, "raw_math")


def _ids_of(path: Path, visited: dict[Path, set[str]]) -> set[str]:
    if path not in visited:
        visited[path] = set(re.findall(r'\bid="([^"]+)"', path.read_text(errors="replace")))
    return visited[path]


def test_every_internal_link_and_anchor_resolves(visits):
    visited = {v.page: v.ids for v in visits}
    broken = []
    for visit in visits:
        for href in visit.links:
            parts = urlsplit(href)
            if parts.scheme or href.startswith(("mailto:", "javascript:")):
                continue
            target = (visit.page.parent / unquote(parts.path)).resolve() if parts.path else visit.page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{visit.page.stem}: {href} (no such file)")
            elif (parts.fragment and target.suffix == ".html"
                  and unquote(parts.fragment) not in _ids_of(target, visited)):
                broken.append(f"{visit.page.stem}: {href} (no such anchor)")
    assert not broken


@pytest.mark.parametrize("word, chapter", [("bubble", "pp"), ("reduce-scatter", "collectives"),
                                           ("rendezvous", "together")])
def test_search_finds_a_chapter_by_a_word_in_it(browser, word, chapter):
    assert word in (ROOT / "book" / f"{chapter}.md").read_text()
    errors, network = [], []
    page = open_page(browser, (SITE / "search.html").as_uri() + f"?q={word}", network, errors)
    page.wait_for_selector("#search-results ul.search li", timeout=20_000)
    hits = page.eval_on_selector_all("#search-results ul.search li a", "links => links.map(a => a.href)")
    page.close()
    assert any(f"/book/{chapter}.html" in hit for hit in hits), hits
    assert not errors and not network


def test_the_figures_of_every_chapter_come_with_their_values(browser):
    """Under a figure, a closed table of the numbers it draws (plots.figure_values); opened by
    a click, it shows them. Diagrams that draw no values (the rank grid, the collectives' grid)
    have none, so the check is per chapter, on its figures of records."""
    missing = []
    for path in pages():
        errors, network = [], []
        page = open_page(browser, path.as_uri(), network, errors)
        images = page.locator("div.cell_output img").count()
        tables = page.locator("details.figure-values")
        if images and not tables.count():
            missing.append(path.stem)
        elif tables.count():
            tables.first.locator("summary").click()
            assert tables.first.locator("table td").first.is_visible(), path.stem
        page.close()
    assert not missing, f"chapters with figures and no table of their values: {missing}"


WIDE_JS = """() => [...document.querySelectorAll('article pre')]
  .filter(pre => pre.scrollWidth > pre.clientWidth + 1)
  .map(pre => pre.textContent.split('\\n').reduce((a, b) => (b.length > a.length ? b : a)).slice(0, 70))"""


def test_no_code_block_scrolls_sideways(browser):
    """At the screenshots' 1280 px, no code block scrolls sideways: the chapters keep code cells to
    79 characters (tests/test_book.py) at a size that shows them whole (multigpu.css), and what
    cells print, the source shown from src/ and shell commands wrap at the column's edge."""
    wide = {}
    for path in pages():
        errors, network = [], []
        page = open_page(browser, path.as_uri(), network, errors)
        if found := page.evaluate(WIDE_JS):
            wide[path.stem] = found
        page.close()
    assert not wide, f"code blocks that scroll sideways (their longest line): {wide}"


FIRST_FIGURE_JS = """() => { const img = document.querySelector('article div.cell_output img');
  return img ? img.getBoundingClientRect().top + window.scrollY : null; }"""


def test_every_chapter_shows_a_figure_on_its_first_screen(browser):
    """A chapter opens on its text and a figure, not a wall of code: at 1280 x 900, each chapter's
    first figure starts within the first screen (the glossary, a table, has none)."""
    late = {}
    for path in pages():
        if path.stem == "glossary":
            continue
        errors, network = [], []
        page = open_page(browser, path.as_uri(), network, errors)
        top = page.evaluate(FIRST_FIGURE_JS)
        page.close()
        if top is None or top >= 900:
            late[path.stem] = top
    assert not late, f"chapters whose first figure starts below the first screen (px from the top): {late}"


def test_every_chapter_offers_its_notebook_and_a_launch_button(visits):
    """The executed notebook to download (.ipynb, outputs included) and a Binder launch that
    opens the chapter, built from the repository setting in _config.yml."""
    repository = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    org_repo = urlsplit(repository).path.strip("/")
    missing = []
    for visit in visits:
        if visit.page.stem == "glossary":  # a page, not a notebook
            continue
        if f"../_sources/book/{visit.page.stem}.ipynb" not in visit.links:
            missing.append(f"{visit.page.stem}: no .ipynb download")
        if not any(link.startswith(f"https://mybinder.org/v2/gh/{org_repo}/") and
                   link.endswith(f"book/{visit.page.stem}.md") for link in visit.links):
            missing.append(f"{visit.page.stem}: no Binder launch")
    assert not missing


# -- the calculator of "Choosing a strategy": the estimator's answers, in the page ------------


@pytest.fixture(scope="module")
def calculator_page(browser):
    errors, network = [], []
    page = open_page(browser, (SITE / "book" / "choosing.html").as_uri(), network, errors)
    page.wait_for_selector("#multigpu-calculator table.mgc-table td[data-category]", timeout=20_000)
    yield page
    page.close()
    assert not errors and not network


def test_the_calculator_grid_is_the_packages_current_one(calculator_page):
    from multigpu.estimator.calculator import GRID_FILE, is_current, stamp_of

    made = calculator_page.evaluate("window.multigpuCalculator.grid.made_by")
    assert is_current(GRID_FILE), "the calculator's grid is older than src/: run make book again"
    assert made["source"] == stamp_of(GRID_FILE)[0], "the site's calculator grid is not the book's: run make book again"


def test_the_calculator_answers_as_the_estimator_does(calculator_page, tmp_path):
    """Sampled settings (seeded) from every strategy, each on a GPU the page names or one it does
    not: the page's bytes per category, phase, pipeline rank and largest batch against `estimate`
    and `predict_largest_batch` called here for that GPU (its kernels, context and cuBLAS
    workspaces, as `estimate --gpu NAME --uncalibrated` asks); a setting the estimator refuses
    shows the estimator's own reason."""
    import random

    from multigpu.config import ConfigError
    from multigpu.estimator import calculator
    from multigpu.estimator.peak import estimate, predict_largest_batch
    from multigpu.estimator.question import GPUS

    grid = calculator_page.evaluate("""() => { const g = window.multigpuCalculator.grid;
        return Object.fromEntries(Object.entries(g.entries).map(([k, e]) => [k, e.error || [e.dp, e.m]])); }""")
    models = calculator.models(tmp_path)
    rng = random.Random(13)
    by_strategy: dict[str, list[str]] = {}
    for key in grid:
        by_strategy.setdefault(key.split("|")[1], []).append(key)
    keys = [k for s in calculator.STRATEGIES for k in rng.sample(sorted(by_strategy[s]), 4)]
    longer = sorted(k for k in grid if int(k.split("|")[-1]) != calculator.SEQ_LEN)  # longer samples
    keys += rng.sample(longer, 8)
    wrong = []
    for key in keys:
        model, strategy, gpus, tp, dtype, checkpointing, seq = key.split("|")
        settings = {"model": model, "strategy": strategy, "gpus": int(gpus), "tp": int(tp), "dtype": dtype,
                    "checkpointing": checkpointing, "optimizer": rng.choice(calculator.OPTIMIZERS),
                    "gpu": rng.choice([*sorted(GPUS), None]), "seq_len": int(seq)}
        setup = calculator.setup_of(models[model], strategy, int(gpus), int(tp), dtype,
                                    {"none": False, "full": True}.get(checkpointing, checkpointing),
                                    settings["optimizer"], settings["gpu"] or "unnamed", seq_len=int(seq))
        if isinstance(grid[key], str):
            with pytest.raises(ConfigError) as refused:
                estimate(setup)
            assert grid[key] == str(refused.value).replace(setup.model, model)
            continue
        dp, m = grid[key]
        settings["global_batch"] = rng.choice([1, 2, 5, 16]) * dp * m
        memory = GPUS[settings["gpu"]] if settings["gpu"] else rng.choice([16, 32, 80, 141]) * 2**30
        page = calculator_page.evaluate("([s, mem]) => [window.multigpuCalculator.answer(s), "
                                        "window.multigpuCalculator.largest(s, mem)]", [settings, memory])
        ours, most = estimate(setup, settings["global_batch"]), predict_largest_batch(setup, memory)
        off = {c: page[0]["per_rank_bytes"][c] - ours.per_rank_bytes[c] for c in ours.per_rank_bytes
               if abs(page[0]["per_rank_bytes"][c] - ours.per_rank_bytes[c]) > 2}  # float sums in another order
        if off or page[0]["phase"] != ours.phase or page[0]["pipeline_rank"] != ours.pipeline_rank or \
                (most.global_batch if most else None) != (page[1]["global_batch"] if page[1] else None):
            wrong.append((key, settings, off, page[0]["phase"], ours.phase, most and most.global_batch,
                          page[1] and page[1]["global_batch"]))
    assert not wrong
    assert len(keys) == 4 * len(calculator.STRATEGIES) + 8


def test_the_calculator_responds_to_input(calculator_page):
    """A reader's change of model, strategy, batch and memory redraws the numbers."""
    from multigpu.estimator.peak import estimate
    from multigpu.estimator.question import Setup

    page = calculator_page

    def shown():
        return {c: int(page.get_attribute(f'#multigpu-calculator td[data-category="{c}"]', "data-bytes"))
                for c in ("params", "activations", "total")}

    from multigpu.estimator.calculator import setup_of

    page.select_option('#multigpu-calculator select[name="model"]', "gpt2")
    page.select_option('#multigpu-calculator select[name="strategy"]', "ddp")
    page.select_option('#multigpu-calculator select[name="gpus"]', "2")
    page.select_option('#multigpu-calculator select[name="gpu"]', "a100-80gb")
    assert page.input_value('#multigpu-calculator input[name="memory"]') == "80"  # the GPU's memory
    page.fill('#multigpu-calculator input[name="global_batch"]', "8")
    small = shown()
    expected = estimate(setup_of("gpt2", "ddp", 2, 1, "fp32", False, "adamw", "a100-80gb"), 8).per_rank_bytes
    assert small == {c: expected[c] for c in small}
    assert expected["total"] > estimate(Setup("gpt2", "ddp", 2, seq_len=256), 8).per_rank_bytes["total"]  # a CPU's
    page.fill('#multigpu-calculator input[name="global_batch"]', "32")
    assert shown()["activations"] > small["activations"] and shown()["params"] == small["params"]
    page.fill('#multigpu-calculator input[name="memory"]', "16")
    at_16 = int(page.get_attribute("#multigpu-calculator", "data-largest"))
    page.fill('#multigpu-calculator input[name="memory"]', "80")
    assert int(page.get_attribute("#multigpu-calculator", "data-largest")) > at_16
    assert "falls at" in page.inner_text("#multigpu-calculator .mgc-said")
    # a longer sample: ddp has none precomputed (the page says which strategies do); cp-scratch cuts it
    page.select_option('#multigpu-calculator select[name="seq_len"]', "1024")
    assert "precomputed for single, fsdp, cp-scratch" in page.inner_text("#multigpu-calculator .mgc-said")
    page.select_option('#multigpu-calculator select[name="strategy"]', "cp-scratch")
    expected = estimate(setup_of("gpt2", "cp-scratch", 2, 1, "fp32", False, "adamw", "a100-80gb", seq_len=1024),
                        32).per_rank_bytes
    assert shown() == {c: expected[c] for c in ("params", "activations", "total")}
    assert "x cp 2" in page.inner_text("#multigpu-calculator .mgc-said")
