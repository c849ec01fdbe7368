# The two commands: `make train` and `make test`. Both create .venv when it is absent.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: train test test-fast venv clean-venv gpu-check

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

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# On a bare CUDA machine with .whl/ carried (docs/gpu.md): no venv, the machine's python3.
GPU_CHECK_OUT ?= runs/gpu-check
gpu-check:
	python3 tools/gpu_check.py run $(GPU_CHECK_OUT)

clean-venv:
	rm -rf $(VENV)
