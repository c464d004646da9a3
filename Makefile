# Two commands matter: `make demo` and `make test`.  Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# packages pinned beside torch and installed with it (the matrix: the paired
# torchvision of a CUDA build, e.g. TORCH_EXTRA='torchvision==0.22.0')
TORCH_EXTRA ?=
# the extras installed into $(VENV); the matrix needs only the suite's (test, models)
EXTRAS ?= dev,docs,models
# releases `make test-matrix` runs the suite on, each in its own .venv-torch-<version>
TORCH_MATRIX ?= 2.7.0 2.9.1 2.11.0 2.13.0 2.14.1
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
comma := ,
space := $(subst ,, )
SPECS := $(TORCH_SPEC) $(TORCH_EXTRA)
STAMP := $(VENV)/.ctxreplay-$(subst $(space),+,$(strip $(subst =,_,$(subst >,_,$(subst <,_,$(SPECS))))))-$(subst $(comma),_,$(EXTRAS))

.PHONY: setup demo pytest test test-matrix lint typecheck bench docs docs-shots clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and explicitly, so no other requirement can pull a
# CUDA build; TORCH_SPEC overrides it (e.g. make test TORCH_SPEC='torch==2.9.1').
$(STAMP): $(PY) pyproject.toml examples/ctxreplay_example_probe/pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(foreach s,$(SPECS),"$(s)")
	$(PIP) install -q -e ".[$(EXTRAS)]" $(foreach s,$(SPECS),"$(s)")
	$(PIP) install -q -e examples/ctxreplay_example_probe $(foreach s,$(SPECS),"$(s)")
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/ctxreplay demo

# the suite: the one pytest command that `make test` and `make test-matrix` both run.
# pytest-xdist runs it on one worker per core, at most 4 (each worker imports torch
# and the model libraries: about 1.5 GB); PYTEST_WORKERS=0 runs it in one process.
# --dist loadgroup keeps the tests marked xdist_group("...") on one worker.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
PYTEST_ARGS := -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup \
	tests examples/ctxreplay_example_probe/tests benchmarks --benchmark-disable
PYTEST_EXTRA ?=

pytest: setup
	$(PY) -m pytest $(PYTEST_ARGS) $(PYTEST_EXTRA)

test: pytest
	$(PY) -m mypy --strict ctxreplay
	$(PY) -m ruff check ctxreplay tests benchmarks examples scripts
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d site

# The suite (pytest) and `ctxreplay demo` on every release in TORCH_MATRIX, each in
# its own venv .venv-torch-<version> made by `make setup`; one table at the end, also
# written to matrix-results.md.  Each standard torch build is several GB: this is
# not part of `make test` or CI.  e.g. make test-matrix TORCH_MATRIX='2.7.0 2.14.1'
test-matrix:
	$(PYTHON) scripts/torch_matrix.py --make "$(MAKE)" --out matrix-results.md $(TORCH_MATRIX)

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
