#!/usr/bin/env bash
# Download the pure-Python packages (and the few compiled ones, as CPython 3.12 x86-64 builds) that a stock CUDA
# image with torch and triton lacks (the server, the tokenizer, the `openai` client of benchmarks.needle), for `benchmarks/gpu/check.sh --wheels DIR` on a GPU machine without a
# package registry. Run on a machine that reaches PyPI:   benchmarks/gpu/wheels.sh [DIR]   (default .whl, ~22 MB)
set -euo pipefail
DIR=${1:-.whl}
mkdir -p "$DIR"
PKGS=(mistral-common==1.13.1 fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 uvicorn==0.55.0
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
      pydantic-extra-types==2.11.1 pycountry==26.2.16 h11==0.16.0 annotated-doc==0.0.7
      typing-extensions==4.16.0
      openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 truststore==0.10.5 sniffio==1.3.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DIR" "${PKGS[@]}"
du -sh "$DIR"
