#!/bin/sh
# The GPU figures P2, P3, P5, P6 of the HiSparse data path as JSON (about 10 minutes on one GPU);
# run from the repository root: benchmarks/gpu/run.sh [--out DIR]
set -e
exec timeout 900 "${PYTHON:-.venv/bin/python}" -m benchmarks.gpu.run --device cuda "$@"
