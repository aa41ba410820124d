# One command each: `make demo` (set up + train a small ColBERT on the MS MARCO sample + evaluate on SciFact),
# `make test` (set up + ruff + the test suite), `make test-slow` (the slow checks), `make bench` (benchmarks),
# `make gpu-check` (first thing on a GPU machine: mixed-precision training, GPU evaluation beside the CPU's, GPU tests,
# planned to fit 240 s; `make gpu-check DRY_RUN=1` runs the same steps small on the CPU).
PYTHON ?= python3
VENV ?= .venv
SHARED ?= $(abspath ../shared)
export HIL_DATA_DIR ?= $(SHARED)/data
export HIL_MODELS_DIR ?= $(SHARED)/models
export HIL_SHARED_DIR ?= $(SHARED)
export TOKENIZERS_PARALLELISM ?= false
# Idle OpenMP threads spin by default; on a 2-core machine shared with FAISS and tokenizers that wastes cores.
export OMP_WAIT_POLICY ?= PASSIVE
BIN := $(VENV)/bin

.PHONY: setup demo paper lint test test-slow test-all bench gpu-check clean

setup: $(VENV)/.installed

# torch is pinned first: 2.13.0's CPU wheel is what this project is tested with, and installing it before the
# package keeps pip from pulling a CUDA build to satisfy the torch range.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $@

# The demo writes under runs/ only (ignored by git): results/demo/metrics.json is the committed record the README's
# table reads, refreshed on purpose with `make demo DEMO_RESULTS=results/demo`. A demo stopped with Ctrl-C resumes
# where it stopped when run again (--resume auto).
DEMO_RESULTS ?= runs/demo/results
demo: setup
	$(BIN)/python train.py fit --config configs/colbert.yaml --config configs/presets/cpu.yaml \
		--trainer.default_root_dir runs/demo --export_dir runs/demo/export --resume auto
	$(BIN)/python evaluate.py --model runs/demo/export --dataset scifact --output $(DEMO_RESULTS)

# The paper's tables at this machine's scale (results/$(PROFILE)/report.md); resumes when rerun.
PROFILE ?= cpu
paper: setup
	$(BIN)/hil paper --profile $(PROFILE)

# ruff first (pyflakes, pycodestyle, import order; pyproject.toml's [tool.ruff]): a lint error fails the suite.
lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: setup
	$(BIN)/python bench/run.py

# Writes runs/gpu-check/gpu-check.json (runs/gpu-check-dry/ with DRY_RUN=1) and a log per step beside it;
# GPU_CHECK_ARGS passes more options (python bench/gpu_check.py --help).
gpu-check: setup
	$(BIN)/python bench/gpu_check.py $(if $(filter-out 0,$(DRY_RUN)),--dry-run) $(GPU_CHECK_ARGS)

clean:
	rm -rf runs results indexes .pytest_cache
