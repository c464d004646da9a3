# Two commands matter: `make demo` and `make test`.  Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.ctxreplay-$(subst =,_,$(subst >,_,$(subst <,_,$(TORCH_SPEC))))

.PHONY: setup demo test lint typecheck bench docs docs-shots clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and explicitly, so no other requirement can pull a
# CUDA build; TORCH_SPEC overrides it (e.g. make test TORCH_SPEC='torch==2.9.1').
$(STAMP): $(PY) pyproject.toml examples/ctxreplay_example_probe/pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,docs,models]" "$(TORCH_SPEC)"
	$(PIP) install -q -e examples/ctxreplay_example_probe "$(TORCH_SPEC)"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/ctxreplay demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests examples/ctxreplay_example_probe/tests benchmarks --benchmark-disable
	$(PY) -m mypy --strict ctxreplay
	$(PY) -m ruff check ctxreplay tests benchmarks examples
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d site

# The documentation site (into site/, git-ignored); every API page comes from docstrings.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# A PNG per page of the built site (headless Chromium, 1280 px wide) into
# build/docs-shots/, for a person to look at; not part of `make test`.
# Needs Chromium (Debian: apt-get install -y chromium); SHOTS_ARGS=--tiles
# adds each whole page, cut into 2000-px tiles (with Pillow).
docs-shots: docs
	$(PY) docs/shots.py site build/docs-shots $(SHOTS_ARGS)

bench: setup
	$(PY) -m pytest -q -p no:cacheprovider benchmarks --benchmark-only -s

clean:
	rm -rf $(VENV) site build *.egg-info
