# The README's commands. Everything installs into a local virtualenv ($(VENV)).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch build to install first. torch==2.13.0 resolves to the CPU wheel where one is
# provided locally; set TORCH="torch --index-url <your CUDA index>" for a GPU build.
TORCH ?= torch==2.13.0
MODEL ?= models/digits

.PHONY: install run train serve test test-slow lint format bench bench-serve protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[serve,train,dev,tracing]'
	touch $@

install: $(VENV)/.installed

HOST ?= 127.0.0.1
PORT ?= 8000

## run: the main job: train NCA on digits into $(MODEL) if it is missing, then serve it
run: install
	@test -f $(MODEL)/manifest.json || $(BIN)/python -m training --data digits --n-components 32 --out $(MODEL)
	$(BIN)/python -m service --model $(MODEL) --host $(HOST) --port $(PORT)

## train: (re)train the default model
train: install
	$(BIN)/python -m training --data digits --n-components 32 --out $(MODEL)

## serve: serve $(MODEL) (must exist)
serve: install
	$(BIN)/python -m service --model $(MODEL) --host $(HOST) --port $(PORT)

## test: lint and the fast test suite
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

## test-slow: the slow tests only
test-slow: install
	$(BIN)/python -m pytest -m slow

lint: install
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## bench: the training benchmark against scikit-learn (long: see benchmarks/README.md)
bench: install
	$(BIN)/python benchmarks/train_vs_sklearn.py

## bench-serve: search and HTTP benchmarks (HTTP needs wrk: apt-get install wrk)
bench-serve: install
	$(BIN)/python benchmarks/search_raw_vs_projected.py
	$(BIN)/python benchmarks/http_load.py

## protos: compile service/oip/protocol/*.proto into the descriptor set the service loads
protos: install
	cd service/oip/protocol && $(abspath $(BIN))/python -m grpc_tools.protoc -I. \
		--descriptor_set_out=protocol.binpb open_inference.proto health.proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
