# The two commands: `make serve` (serve the packaged demo model) and `make test`.
# Each sets up what it needs: a virtual environment in .venv and the packages;
# the first time, llama-cpp-python compiles llama.cpp (~8 min on 2 cores; pip
# caches the wheel after that).

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Only llama.cpp's compile progress ("[ 42%] Building ...") and pip's verdicts are shown.
PROGRESS := grep --line-buffered -E '\[ *[0-9]+%\]|Successfully installed|ERROR|error:' || true

.PHONY: serve test lint typecheck unit bench demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.serve-deps: pyproject.toml | $(BIN)/python
	@echo "==> installing quantroute and llama-cpp-python (compiles llama.cpp the first time)"
	$(BIN)/pip install -v -e . 2>&1 | $(PROGRESS)
	$(BIN)/python -c "import llama_cpp, quantroute"
	touch $@

# torch==2.13.0 first: a CPU build that installs from disk on this project's machines,
# so the `train` extra's range is already met and pulls nothing larger.
$(VENV)/.test-deps: pyproject.toml $(VENV)/.serve-deps
	@echo "==> installing test and training dependencies"
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,train,server-peer]'
	touch $@

serve: $(VENV)/.serve-deps
	$(BIN)/quantroute serve $(ARGS)

lint: $(VENV)/.test-deps
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(VENV)/.test-deps
	$(BIN)/mypy

unit: $(VENV)/.test-deps
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck unit

bench: $(VENV)/.test-deps
	$(BIN)/python benchmarks/bench_serving.py $(ARGS)

demo: $(VENV)/.test-deps
	$(BIN)/quantroute demo build $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
