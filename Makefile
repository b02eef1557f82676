# The two commands: `make serve` (serve the packaged demo model) and `make test`.
# Each sets up what it needs: a virtual environment in .venv and the packages;
# the first time, scripts/llama_build.sh compiles llama.cpp for a portable CPU
# baseline (never the build machine's own CPU flags), with CUDA where there is a GPU and a toolkit
# (~8 min on 2 cores), and caches the wheel under ~/.cache/quantroute, keyed by
# its flags.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test lint typecheck unit bench demo clean llama llama-server

# The gRPC API's code, generated from the .proto (gitignored: never committed). The
# proto's folder is mapped onto the package, so the modules import each other as
# quantroute.grpcapi._gen.*; the .pyi stubs are what mypy reads.
PROTO_DIR := proto/quantroute/v1
PROTO := $(PROTO_DIR)/quantroute.proto
GRPC_GEN := src/quantroute/grpcapi/_gen

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Every time (a second when nothing changed): the venv's llama.cpp must be the build
# this machine should have. It shows the build's progress when it compiles.
llama: | $(BIN)/python
	@bash scripts/llama_build.sh $(VENV)

$(VENV)/.serve-deps: pyproject.toml | llama
	@echo "==> installing quantroute"
	$(BIN)/pip install -q -e .
	$(BIN)/python -c "import llama_cpp, quantroute"
	touch $@

# grpcio-tools (the `proto` extra): what generates the gRPC code.
$(VENV)/.proto-deps: pyproject.toml $(VENV)/.serve-deps
	$(BIN)/pip install -q -e '.[proto]'
	touch $@

$(GRPC_GEN)/quantroute_pb2.py: $(PROTO) $(VENV)/.proto-deps
	@echo "==> generating the gRPC code from $(PROTO)"
	rm -rf $(GRPC_GEN)
	mkdir -p $(GRPC_GEN)
	$(BIN)/python -m grpc_tools.protoc -Iquantroute/grpcapi/_gen=$(PROTO_DIR) \
		--python_out=src --pyi_out=src --grpc_python_out=src $(PROTO)
	touch $(GRPC_GEN)/__init__.py
	$(BIN)/python -c "import quantroute.grpcapi"

# `make .venv`: the environment `make serve` runs in, without serving.
$(VENV): $(VENV)/.serve-deps $(GRPC_GEN)/quantroute_pb2.py

# torch==2.13.0 first: a CPU build that installs from disk on this project's machines,
# so the `train` extra's range is already met and pulls nothing larger.
$(VENV)/.test-deps: pyproject.toml $(VENV)/.serve-deps $(GRPC_GEN)/quantroute_pb2.py | llama
	@echo "==> installing test and training dependencies"
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,train,server-peer]'
	touch $@

serve: $(VENV)/.serve-deps $(GRPC_GEN)/quantroute_pb2.py | llama
	$(BIN)/quantroute serve $(ARGS)

lint: $(VENV)/.test-deps
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(VENV)/.test-deps
	$(BIN)/mypy

# llama.cpp's own llama-server, from the same sources and flags (cached outside the
# checkout by its flags: minutes once, a second after): the remote-branch tests serve
# demo files with it, and the serving benchmark compares against it.
llama-server: | $(BIN)/python
	@bash scripts/llama_server_build.sh $(BIN)/python >/dev/null

unit: $(VENV)/.test-deps llama-server
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck unit

bench: $(VENV)/.test-deps
	$(BIN)/python benchmarks/bench_serving.py $(ARGS)

demo: $(VENV)/.test-deps
	$(BIN)/quantroute demo build $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
	rm -rf $(GRPC_GEN)
