#!/usr/bin/env bash
# Set up (if needed) and run the test suite, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --llm  # the suite covers the LLM half (lm-eval task pools, the offline LLM world)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "${FEATCAL_VENV:-.venv}/bin/python" -m pytest -q "$@"
