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

.PHONY: setup chromium demo test test-unit test-slow test-notebooks lint clean

setup: $(STAMP) chromium

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] >= (3, 11), "grpo_lab needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(PIP_ARGS) -e ".[cpu,notebooks,dev]"
	touch $(STAMP)

# The dashboard's browser test (tests/test_dashboard_browser.py) drives the system Chromium,
# never playwright's own download: install Debian's `chromium` when none is found and apt-get
# can (as root, or with sudo that needs no password); otherwise that test skips and says why.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  if command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
	    sudo=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
	    echo "installing chromium with apt-get (for the dashboard's browser test)"; \
	    $$sudo apt-get update -qq >/dev/null && \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	  else echo "no chromium, and apt-get cannot install it here: the dashboard's browser test will skip"; fi; }

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
