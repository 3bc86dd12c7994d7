"""The package in a reader's own environment: built as a wheel, installed with pip into a new
virtual environment holding the lowest versions that pyproject.toml's ranges allow, then used
from a folder outside any checkout: `run` for two steps, `estimate`, and `figures` for one
small experiment, whose records must land in ./results of that folder (README, "Running the
chapters elsewhere"). References: pip's own resolver and pyproject.toml's declared ranges.

About two minutes (most of it unpacking torch), so it is marked slow; CI runs it anyway.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def lowest(requirement: str) -> str:
    """'name>=X,<Y' -> 'name==X': the oldest release the range admits."""
    name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", requirement).groups()
    floor = re.search(r">=\s*([\w.]+)", spec)
    assert floor, f"{requirement!r} in pyproject.toml has no lower bound: the lowest release cannot be tested"
    return f"{name}=={floor.group(1)}"


def sh(*args, cwd: Path, env: dict | None = None, timeout: int = 300) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_into_a_bare_environment_works_from_any_folder(tmp_path):
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [lowest(r) for r in declared]
    (tmp_path / "lowest.txt").write_text("\n".join(floors) + "\n")

    source = tmp_path / "source"  # what the wheel is built from (a build in the checkout would leave build/ there)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", tmp_path / "dist", source, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("multigpu-*.whl")
    sh(sys.executable, "-m", "venv", tmp_path / "venv", cwd=tmp_path)
    python = tmp_path / "venv" / "bin" / "python"
    sh(python, "-m", "pip", "install", "--quiet", "-c", tmp_path / "lowest.txt", wheel, cwd=tmp_path, timeout=600)

    installed = {p["name"].lower(): p["version"] for p in
                 json.loads(sh(python, "-m", "pip", "list", "--format", "json", cwd=tmp_path).splitlines()[0])}
    for floor in floors:  # pip took the oldest release of every range
        name, version = floor.split("==")
        assert installed[name.lower()].split("+")[0].startswith(version), (name, installed[name.lower()])
    assert "pandas" not in installed and "deepspeed" not in installed  # extras stay out unless asked for

    elsewhere = tmp_path / "elsewhere"  # no checkout here or above: records go to ./results
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in {"MULTIGPU_RESULTS", "PYTHONPATH"}}
    env["MULTIGPU_PROGRESS"] = "0"
    out = sh(tmp_path / "venv" / "bin" / "multigpu", "run", "--strategy", "ddp", "--world-size", "2",
             "--steps", "2", cwd=elsewhere, env=env)
    assert "over 2 steps" in out
    out = sh(python, "-m", "multigpu", "estimate", "--model", "gpt2", cwd=elsewhere, env=env)
    assert "total" in out
    out = sh(python, "-m", "multigpu", "figures", "--experiments", "link_model", cwd=elsewhere, env=env)
    print(out)
    assert f"writing to {elsewhere / 'results'}/<machine>/ (from the current folder" in out
    written = list((elsewhere / "results").glob("*/link_model.jsonl"))
    assert len(written) == 1 and written[0].read_text().strip(), out
    site = sh(python, "-c", "import multigpu, sys; print(multigpu.__file__)", cwd=elsewhere, env=env)
    assert str(tmp_path / "venv") in site  # the installed copy ran, not the checkout's


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            found[name.strip().lower()] = version.strip()
    return found


def test_every_declared_range_admits_the_pinned_release():
    """`make` (requirements.txt's pins) and `pip install` (pyproject's ranges) agree."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = pins(ROOT / "requirements.txt")
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra
                 if not r.startswith("multigpu")]
    for req in declared:
        assert req.name.lower() in pinned, f"{req.name} is declared but not pinned in requirements.txt"
        assert req.specifier.contains(pinned[req.name.lower()]), (req, pinned[req.name.lower()])


def test_binder_installs_the_pinned_torch_as_a_cpu_build_and_the_package():
    binder = pins(ROOT / "binder" / "requirements.txt")
    assert binder["torch"] == pins(ROOT / "requirements.txt")["torch"] + "+cpu"
    assert "-r ../requirements.txt" in (ROOT / "binder" / "requirements.txt").read_text()
    assert "pip install --no-deps -e ." in (ROOT / "binder" / "postBuild").read_text()


def test_the_site_has_repository_and_launch_buttons_from_one_setting():
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["repository"]["url"].startswith("https://github.com/")
    assert config["html"]["use_repository_button"] is True
    assert config["launch_buttons"]["binderhub_url"] == "https://mybinder.org"
    assert "JUPYTERHUB_URL" in (ROOT / "Makefile").read_text()
