# Every target creates .venv if it is missing and installs what it needs, so on a fresh
# machine `make demo` and `make test` are the only two commands anyone has to type.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
NPROC  ?= 8
PYTEST_ARGS ?=

.PHONY: demo test lint bench pytest clean venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# Core install: numpy + ml_dtypes, enough for the demo.
$(VENV)/.core: pyproject.toml | $(PY)
	$(PIP) install -e .
	touch $@

# Everything the suite needs: test tools, MPICH + mpi4py from PyPI.
$(VENV)/.dev: pyproject.toml $(VENV)/.core
	$(PIP) install -e ".[test,mpi]"
	touch $@

venv: $(VENV)/.dev

demo: $(VENV)/.core
	$(VENV)/bin/meshrun --nproc-per-node $(NPROC) examples/demo.py

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check meshcomm tests examples bench
	$(VENV)/bin/ruff format --check meshcomm tests examples bench
	$(VENV)/bin/mypy

pytest: $(VENV)/.dev
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS)

test: lint pytest

bench: $(VENV)/.dev
	$(VENV)/bin/meshcomm-bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
