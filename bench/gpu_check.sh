#!/usr/bin/env bash
# The GPU recipe's first check, within 10 minutes on one GPU: agentrl's vLLM rollouts against
# raw vLLM in tokens/s, hf decoding, and a training step's time and CUDA memory on
# examples/train_alfworld_gpu.yaml (bench/gpu_check.py says how; it writes bench/gpu_check.json).
#   bench/gpu_check.sh                  Qwen/Qwen2.5-1.5B-Instruct, from the Hub or its cache
#   bench/gpu_check.sh --random-init    the same shapes with random weights: nothing to download
#   bench/gpu_check.sh --quick          every part on CPU with the tiny model (no GPU needed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec timeout 600 "$PY" bench/gpu_check.py "$@"
