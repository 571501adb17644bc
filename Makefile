# The two set-up commands of the README. Both create .venv (torch 2.13.0 CPU build, triton 3.9.0: the versions CI
# runs; pyproject.toml states the supported ranges) and install hisparse.
# `make demo` serves the built-in tiny checkpoint on http://127.0.0.1:8000/v1 until Ctrl-C.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/hisparse: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[server,test,bench]' torch==2.13.0 triton==3.9.0
	touch $@

# the oldest supported triton (the CUDA image's), for compiling every kernel ahead of time under it too
.venv-triton36/.installed: Makefile
	$(PY) -m venv .venv-triton36
	.venv-triton36/bin/pip install -q torch==2.13.0 triton==3.6.0 numpy
	touch $@

# vLLM (CPU build) in its own venv, for the connector's end-to-end test (about 3 minutes the first time)
.venv-vllm/.hisparse-vllm-installed: pyproject.toml scripts/install_vllm.sh
	scripts/install_vllm.sh

.PHONY: demo test
demo: $(BIN)/hisparse
	$(BIN)/hisparse serve

# two pytest workers (pytest-xdist), one per core: each test runs single-threaded, and the slowest ones are sm_90
# compiles and subprocess servers that leave a core idle; worksteal rebalances the long tests at the end
test: $(BIN)/hisparse .venv-vllm/.hisparse-vllm-installed .venv-triton36/.installed
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist worksteal
