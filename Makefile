# The two commands the README starts with. Both set up what they need on a fresh machine, at the versions
# pinned in constraints/ci.txt, so a new release on the index never changes what they install:
#   make demo   torch, devgraph's core dependencies and the plug-ins: nothing else (seconds, on the CPU)
#   make test   also the `test` extra (pytest, ruff, mypy, triton, transformers, aiohttp, openai...), then
#               lint and the whole suite. It is what CI runs (.ci/run, in a fresh virtual environment).
# A torch already installed at another release than the pinned one (a GPU machine's CUDA build) is kept:
# `tools/pins.py select` then leaves out the pins of torch and of what it requires.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
CONSTRAINTS := constraints/ci.txt
PLUGINS := -e backends/cuda -e backends/rocm -e backends/npu
# Editable installs build with the setuptools installed here (pinned too: torch requires it), not with
# whatever setuptools the index has that day.
INSTALL = $(PIP) install -q --no-build-isolation -c $(shell $(PYTHON) tools/pins.py select)
LINTED := devgraph devgraph_launcher backends tests benchmarks tools

.PHONY: demo test setup setup-test torch lint constraints test-latest test-hf-range

# Installs torch only when none is importable (a GPU machine keeps its own CUDA build).
torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "installing torch (pinned in $(CONSTRAINTS))"; \
	  $(PIP) install -q -c $(CONSTRAINTS) torch; }
	@$(PYTHON) -c "import setuptools" 2>/dev/null || $(PIP) install -q -c $(CONSTRAINTS) setuptools
	@# torch warns "Failed to initialize NumPy" at every import without numpy; devgraph does not use it.
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PIP) install -q -c $(CONSTRAINTS) numpy

setup: torch
	$(INSTALL) -e . $(PLUGINS)

setup-test: torch
	$(INSTALL) -e '.[test]' $(PLUGINS)

demo: setup
	$(PYTHON) -m devgraph demo

lint:
	$(PYTHON) -m ruff check $(LINTED)
	$(PYTHON) -m ruff format --check $(LINTED)
	$(PYTHON) -m mypy devgraph devgraph_launcher backends/cuda/devgraph_cuda backends/rocm/devgraph_rocm backends/npu/devgraph_npu tools

test: setup-test lint
	$(PYTHON) -m pytest -q

# Rewrite constraints/ci.txt from fresh environments with the newest releases pyproject.toml allows.
constraints:
	$(PYTHON) tools/pins.py generate

# Neither target below is part of `make test` or CI: they install from the index without the pins, each in
# a throw-away environment under build/venvs (TORCH=... picks another torch; the default is the pinned one).
TORCH ?= torch==$(shell $(PYTHON) tools/pins.py version torch)

# The whole suite on the newest releases of everything, transformers past the tested upper bound included
# (pip then warns that devgraph declares a narrower range: that range is what this target checks ahead of time).
test-latest:
	TORCH='$(TORCH)' tools/suite-in-fresh-venv.sh latest --pip "-e .[test] $(PLUGINS)" --pip "--upgrade transformers" -- -q

# tests/test_hf.py under the oldest and the newest transformers pyproject.toml supports.
HF_OLDEST := 5.17.0
HF_NEWEST = $(shell $(PYTHON) tools/pins.py version transformers)
test-hf-range:
	status=0; for version in $(HF_OLDEST) $(HF_NEWEST); do \
	  TORCH='$(TORCH)' tools/suite-in-fresh-venv.sh transformers-$$version \
	    --pip "-e .[transformers] $(PLUGINS) transformers==$$version pytest pytest-timeout" \
	    -- -q tests/test_hf.py || status=1; \
	done; exit $$status
