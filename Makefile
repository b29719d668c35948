# The README's commands. Everything installs into a local virtualenv ($(VENV)).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch build to install first. torch==2.13.0 resolves to the CPU wheel where one is
# provided locally; set TORCH="torch --index-url <your CUDA index>" for a GPU build.
TORCH ?= torch==2.13.0
MODEL ?= models/digits

.PHONY: install run train serve test test-slow lint format bench bench-serve protos clean lock docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# Every package but torch is pinned by requirements/lock.txt (a constraints file: the extras
# in pyproject.toml say what is installed, the lock at which version). `make lock` refreshes it.
EXTRAS := serve,train,dev,tracing,export
# setup.py builds the native training kernels: a changed C source reinstalls (rebuilds) them
KERNEL_SOURCES := $(wildcard training/objectives/kernels/*.c training/objectives/kernels/levels.py)
$(VENV)/.installed: pyproject.toml setup.py requirements/lock.txt $(KERNEL_SOURCES) | $(BIN)/python
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -c requirements/lock.txt -e '.[$(EXTRAS)]'
	touch $@

## lock: re-resolve every extra in a fresh virtualenv and write requirements/lock.txt
lock: $(BIN)/python
	rm -rf build/lock-venv && $(PYTHON) -m venv build/lock-venv
	build/lock-venv/bin/pip install -q --upgrade pip
	build/lock-venv/bin/pip install -q $(TORCH)
	build/lock-venv/bin/pip install -q '.[$(EXTRAS)]'
	$(BIN)/python tools/write_lock.py build/lock-venv/bin/python requirements/lock.txt

## docs: the documentation site in build/site (fails on a broken link or an orphan page)
docs: install
	$(BIN)/mkdocs build --strict --quiet

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
	$(BIN)/mkdocs build --strict --quiet
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
