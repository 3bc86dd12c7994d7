# Train one model on many GPUs: build the book, run the tests, refresh the figures.
# Every target installs what it needs first (a virtual environment in .venv).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install test gpu-check book notebooks figures lab clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

install: $(STAMP)  ## create .venv and install the pinned dependencies and the package

# The test modules are spread over worker processes (pytest-xdist), a module's tests in one worker, since
# modules share runs through their own caches; tests/conftest.py sizes the workers for this machine's cores
# (TEST_WORKERS=1 runs them one at a time, in this process).
TEST_WORKERS ?= auto
test: $(STAMP)  ## run the whole test suite (unit, parity on 2 and 4 processes, chapters)
	$(PY) -m pytest $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Not part of `make test` (pytest does not collect tests/gpu_check.py): two steps of every strategy
# family over NCCL against one GPU, the estimator against the CUDA allocator, the chapters' GPU live
# cells; skips what needs more GPUs than the machine has. Summary: _build/gpu-check/summary.md.
# MULTIGPU_GPU_CHECK_ON_CPU=2 runs it on the CPU as if there were 2 devices (its self-check).
gpu-check: $(STAMP)  ## on a machine with CUDA GPUs: every strategy on the GPUs (under 10 minutes)
	$(PY) -m pytest tests/gpu_check.py

# JUPYTERHUB_URL=https://your.hub adds a JupyterHub launch button to every chapter (_config.yml)
JUPYTERHUB_URL ?=
BOOK_CONFIG := $(if $(JUPYTERHUB_URL),--config _build/_config.yml,)

# MathJax is served by the site itself (no page needs the network): installed from the npm
# registry into _build/static, which _config.yml adds to the site's _static/ (its mathjax_path
# names the version, the one place it is set).
MATHJAX_VERSION := $(shell sed -n 's|^ *mathjax_path: mathjax/\([0-9.]*\)/.*|\1|p' _config.yml)
MATHJAX := _build/static/mathjax/$(MATHJAX_VERSION)
$(MATHJAX)/tex-mml-chtml.js:
	@command -v npm >/dev/null || { echo "make book needs npm (Node.js) to install MathJax, which the site serves" \
	    "itself so that formulas render offline: install Node.js (Debian: apt install npm), then run make book again" >&2; exit 1; }
	npm install --silent --no-audit --no-fund --prefix _build/npm mathjax@$(MATHJAX_VERSION)
	rm -rf _build/static/mathjax && mkdir -p $(MATHJAX)
	cd _build/npm/node_modules/mathjax/es5 && cp -r tex-mml-chtml.js input output ui a11y adaptors $(CURDIR)/$(MATHJAX)/

# MULTIGPU_TRACE_CACHE: the estimator's model traces are kept in _build/traces, so chapters that
# estimate the same model trace it once (keyed by the tracing code and versions: a change retraces)
book: $(STAMP) $(MATHJAX)/tex-mml-chtml.js  ## execute every chapter on this machine and build the HTML site in _build/html
	if [ -n "$(JUPYTERHUB_URL)" ]; then mkdir -p _build && $(PY) -c 'import sys, yaml; \
	    c = yaml.safe_load(open("_config.yml")); c["launch_buttons"]["jupyterhub_url"] = sys.argv[1]; \
	    yaml.safe_dump(c, open(sys.argv[2], "w"), sort_keys=False)' "$(JUPYTERHUB_URL)" _build/_config.yml; fi
	MULTIGPU_PROGRESS=0 MULTIGPU_TRACE_CACHE=$(CURDIR)/_build/traces \
	    $(VENV)/bin/jupyter-book build . -W -n --keep-going $(BOOK_CONFIG) $(BOOK_FLAGS)

notebooks: $(STAMP)  ## export .ipynb copies of the chapters into _build/notebooks
	mkdir -p _build/notebooks
	for f in book/*.md; do $(VENV)/bin/jupytext --to ipynb -o _build/notebooks/$$(basename $${f%.md}).ipynb $$f; done

figures: $(STAMP)  ## re-run the experiments on this machine (results/<machine>/), then rebuild the book
	$(PY) -m multigpu figures
	rm -rf _build/.jupyter_cache  # the chapters read the new records: execute them all again
	$(MAKE) book BOOK_FLAGS=--all

lab: $(STAMP)  ## open the chapters as notebooks in JupyterLab
	$(VENV)/bin/jupyter lab book/

clean:  ## remove the built book and caches (keeps .venv and results)
	rm -rf _build .pytest_cache .ruff_cache
