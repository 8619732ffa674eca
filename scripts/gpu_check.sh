#!/usr/bin/env bash
# The checks that need a GPU, in one command (issue 62): the CUDA tests, FeatCal at the CLIP ViT-B/32 TA8 shape
# (n = 256) and the Llama-3.2-3B shape out of core at 2 layers; writes OUT (default experiments/results/gpu_check)
# gpu_check.json and gpu_check.md. Without CUDA it says so in one line and exits 2. --llama70b adds issue 62's
# Llama-3.1-70B-shape run (one layer, out of core; 28 GiB of disk, several minutes more).
#   bash scripts/gpu_check.sh [OUT] [--llama70b]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=experiments/results/gpu_check
if [ $# -gt 0 ] && [[ $1 != --* ]]; then OUT=$1; shift; fi
VENV=${FEATCAL_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  bash scripts/setup.sh --llm >&2
fi
exec "$VENV/bin/python" experiments/scripts/gpu_check.py --device cuda --out "$OUT" "$@"
