#!/usr/bin/env bash
# The CUDA path in one short run (under 5 minutes): install, then 2 stages on one GPU, greedy output against
# the transformers fp32 oracle (tie-aware) and decode tok/s. Where torch already imports with CUDA, `make
# install` leaves it alone. Usage: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "gpu_check: no nvidia-smi" >&2; exit 2; }
timeout 200 make install >/tmp/ringshm-gpu-install.log 2>&1 || { tail -20 /tmp/ringshm-gpu-install.log; exit 1; }
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
timeout 240 "$PYTHON" bench/gpu_check.py
