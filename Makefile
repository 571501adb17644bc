# The two set-up commands of the README. Both create .venv (torch==2.13.0 CPU build) and install hisparse.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/hisparse: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: demo test
demo: $(BIN)/hisparse
	$(BIN)/hisparse generate --prompt "hello" --max-tokens 8

test: $(BIN)/hisparse
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q
