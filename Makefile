# The two commands: `make train` and `make test`. Both create .venv when it is absent.
# `make lint` checks style alone; `make format` rewrites the tree to pass it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: train test test-fast lint format venv clean-venv gpu-check

venv: $(STAMP)

# Re-run when the pins change; pip is idempotent, so a re-run installs only what changed.
$(STAMP): requirements/base.txt requirements/cpu.txt requirements/test.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24" "setuptools>=70" wheel
	$(PY) -m pip install --quiet -r requirements/cpu.txt -r requirements/test.txt
	# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm`
	# on the CPU torch; triton is unused on CPU (docs/platform.md).
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/megatron-rl train --config examples/dapo.yaml

# Lint first: it takes a second, so a style slip fails CI before the long test run starts.
# Two pytest-xdist workers: one starts with the Slurm tests, which mostly wait on the cluster,
# the other with the unit tests; then both take the other modules, heaviest first
# (tests/ci_schedule.py, docs/benchmarks.md). `make test PYTEST_WORKERS=` runs one process.
PYTEST_WORKERS ?= -n 2 --slurm-beside-the-rest
test: $(STAMP) lint
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Ruff's settings are in pyproject.toml (tool config only; setup.py still builds the package).
LINT_PATHS := megatron_rl megatron_rl_lab tests tools setup.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS) && $(VENV)/bin/ruff format --check $(LINT_PATHS)

# Format first, then apply the safe lint fixes (import order, unused imports); whatever
# `make lint` still reports after this needs a hand fix.
format: $(STAMP)
	$(VENV)/bin/ruff format $(LINT_PATHS)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

# On a bare CUDA machine with .whl/ carried (docs/gpu.md): no venv, the machine's python3.
GPU_CHECK_OUT ?= runs/gpu-check
gpu-check:
	python3 tools/gpu_check.py run $(GPU_CHECK_OUT)

clean-venv:
	rm -rf $(VENV)
