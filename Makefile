# The README's commands. Everything installs into a local virtualenv ($(VENV)).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch build to install first. torch==2.13.0 resolves to the CPU wheel where one is
# provided locally; set TORCH="torch --index-url <your CUDA index>" for a GPU build.
TORCH ?= torch==2.13.0
MODEL ?= models/digits

.PHONY: install run train test test-slow lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[serve,train,dev]'
	touch $@

install: $(VENV)/.installed

## run: the main job: train NCA on digits and write the artifact to $(MODEL)
run: install
	$(BIN)/python -m training --data digits --n-components 32 --out $(MODEL)

train: run

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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
