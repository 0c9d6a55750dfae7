#!/usr/bin/env bash
# The CUDA path in one prepared run (see bench/gpu.py): bash bench/gpu.sh [--cpu]
# On the GPU machine: the checkout's .venv if there is one, else the machine's python with this repo's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OUT=${OUT:-bench-gpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec timeout 480 "$PY" bench/gpu.py --out "$OUT" "$@"
