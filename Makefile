# resq: make install | run | test | lint | bench
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# torch is pinned: on a CPU-only machine this takes the local CPU build; on a GPU
# host PyPI's default Linux wheel (CUDA) is the one wanted.
TORCH := torch==2.13.0

.PHONY: install run test test-fast lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[gpu,local,dev]'
	@touch $(STAMP)

run: install  ## Run everything on the embedded defaults (resq up)
	$(BIN)/resq up

test: install  ## The whole test suite (starts real Redis-backed processes)
	$(BIN)/python -m pytest

test-fast: install  ## Unit tests only
	$(BIN)/python -m pytest tests/unit

lint: install  ## ruff + mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy resq api workers gpu_worker

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
