#!/usr/bin/env bash
# Set up (if needed) and run the test suites, offline: the product's (tests/, which run without the experiments
# package) and then the experiments' (experiments/tests/). Arguments go to pytest for both, e.g.
#   bash scripts/test.sh -m "not slow"     # the fast subset for the inner loop
#   bash scripts/test.sh -k contract       # a selection (a suite where nothing is selected counts as passed)
# The tests run on one pytest-xdist worker per core (FEATCAL_TEST_WORKERS=0: in the pytest process itself).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --llm  # the suites cover the LLM half (lm-eval task pools, the offline LLM world)
# Bytecode for what only the tests import (setup.sh compiles what the product imports): once, not in every process.
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHON="${FEATCAL_VENV:-.venv}/bin/python"
status=0
for suite in tests experiments/tests; do
  echo "== $suite"
  rc=0
  "$PYTHON" -m pytest -q -n "${FEATCAL_TEST_WORKERS:-auto}" "$suite" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then rc=0; fi  # no test selected in this suite
  if [ "$rc" -ne 0 ]; then status=$rc; fi
done
exit "$status"
