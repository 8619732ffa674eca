#!/usr/bin/env bash
# The checks that need a GPU, in one command (issue 62): the CUDA tests, FeatCal at the CLIP ViT-B/32 TA8 shape
# (n = 256) and the Llama-3.2-3B shape out of core at 2 layers; writes OUT (default experiments/results/gpu_check)
# gpu_check.json and gpu_check.md. Without CUDA it says so in one line and exits 2.
#   bash scripts/gpu_check.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-experiments/results/gpu_check}
VENV=${FEATCAL_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  bash scripts/setup.sh --llm >&2
fi
exec "$VENV/bin/python" experiments/scripts/gpu_check.py --device cuda --out "$OUT"
