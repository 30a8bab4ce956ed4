# The README's commands. Each sets up from nothing (a .venv with the pinned dependencies) first.
#   make demo    set up, then run the main job
#   make test    set up, then run every test tier that CI runs (unit + slow + notebooks)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra pip options, e.g. PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# for a CPU-only torch on a machine that reaches that index.
PIP_ARGS ?=

.PHONY: setup demo test test-unit test-slow test-notebooks lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] >= (3, 11), "grpo_lab needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(PIP_ARGS) -e ".[cpu,notebooks,dev]"
	touch $(STAMP)

demo: setup
	$(BIN)/grpo-lab demo

test: setup
	$(BIN)/python -m pytest

test-unit: setup
	$(BIN)/python -m pytest -m "not notebook and not slow"

test-slow: setup
	$(BIN)/python -m pytest -m slow

test-notebooks: setup
	$(BIN)/python -m pytest -m notebook

lint: setup
	$(BIN)/ruff check grpo_lab tests benchmarks

clean:
	rm -rf $(VENV) .grpo_lab runs .pytest_cache
