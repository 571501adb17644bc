#!/usr/bin/env bash
# One check of hisparse on a GPU machine with a stock CUDA image (torch >= 2.11, triton >= 3.6) and no package
# registry: the CUDA tests, `hisparse serve --device cuda` with its defaults answering needle prompts (HiSparse
# on == off), and the GPU figures P2 P3 P5 P6 P7. Runs from the tree; the packages the image lacks come as
# wheels (benchmarks/gpu/wheels.sh downloads them on a machine with a registry; docs/gpu.md).
#   benchmarks/gpu/check.sh DIR [--wheels WHEELDIR] [--quick]      (full: <= 6 minutes, --quick: <= 2.5)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: benchmarks/gpu/check.sh DIR [--wheels WHEELDIR] [--quick]}
shift
WHEELS="" ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=$2; shift 2 ;;
        *) ARGS+=("$1"); shift ;;       # --quick, --device cpu (a dry run of the script on a machine without a GPU)
    esac
done
PY=${PYTHON:-python3}
SITE=${TMPDIR:-/tmp}/hisparse-site
if [ -n "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu.check "$OUT" "${ARGS[@]}"
