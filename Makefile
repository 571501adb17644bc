# The two set-up commands of the README. Both create .venv (torch==2.13.0 CPU build) and install hisparse.
# `make demo` serves the built-in tiny checkpoint on http://127.0.0.1:8000/v1 until Ctrl-C.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/hisparse: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[server,test,bench]'
	touch $@

# vLLM (CPU build) in its own venv, for the connector's end-to-end test (about 3 minutes the first time)
.venv-vllm/.hisparse-vllm-installed: pyproject.toml scripts/install_vllm.sh
	scripts/install_vllm.sh

.PHONY: demo test
demo: $(BIN)/hisparse
	$(BIN)/hisparse serve

test: $(BIN)/hisparse .venv-vllm/.hisparse-vllm-installed
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q
