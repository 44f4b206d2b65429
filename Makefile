# The two commands the README starts with. Both set up everything they need on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PLUGINS := -e backends/cuda -e backends/rocm -e backends/npu

.PHONY: demo test setup lint

# Installs torch only when none is importable (a GPU machine keeps its own CUDA build).
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' $(PLUGINS)

demo: setup
	$(PYTHON) -m devgraph demo

lint:
	$(PYTHON) -m ruff check devgraph backends tests benchmarks
	$(PYTHON) -m ruff format --check devgraph backends tests benchmarks
	$(PYTHON) -m mypy devgraph backends/cuda/devgraph_cuda backends/rocm/devgraph_rocm backends/npu/devgraph_npu

test: setup lint
	$(PYTHON) -m pytest -q
