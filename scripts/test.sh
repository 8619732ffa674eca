#!/usr/bin/env bash
# Set up (if needed) and run the test suites, offline: the product's (tests/, which run without the experiments
# package) and then the experiments' (experiments/tests/). Arguments go to pytest for both, e.g.
#   bash scripts/test.sh -m "not slow"     # the fast subset for the inner loop
#   bash scripts/test.sh -k contract       # a selection (a suite where nothing is selected counts as passed)
# The tests run on one pytest-xdist worker per core (FEATCAL_TEST_WORKERS=0: in the pytest process itself).
set -euo pipefail
cd "$(dirname "$0")/.."
# Disk, checked before anything is installed: a full disk otherwise shows up minutes later as one world build's
# I/O error. Measured from a clean clone (.ci/run, 2026-11-27): the venv 6.4 GiB, the suites' temporary folders
# 2.1 GiB at their peak (the mini LLM world: four 135M-parameter checkpoints); about 100 MiB of slack each.
VENV=${FEATCAL_VENV:-.venv}
TMP=${TMPDIR:-/tmp}
VENV_MIB=6600
TMP_MIB=2200
fs_of() {  # the mount point holding $1, or its nearest folder that exists
  local folder=$1
  while [ ! -e "$folder" ]; do folder=$(dirname "$folder"); done
  df -P "$folder" | awk 'NR==2 {print $6}'
}
declare -A need_mib=()
[ -x "$VENV/bin/python" ] || need_mib[$(fs_of "$VENV")]=$VENV_MIB
tmp_fs=$(fs_of "$TMP")
need_mib[$tmp_fs]=$(( ${need_mib[$tmp_fs]:-0} + TMP_MIB ))
for fs in "${!need_mib[@]}"; do
  free_mib=$(( $(df -Pk "$fs" | awk 'NR==2 {print $4}') / 1024 ))
  if [ "$free_mib" -lt "${need_mib[$fs]}" ]; then
    echo "scripts/test.sh: $free_mib MiB free on $fs, where the tests need about ${need_mib[$fs]} MiB" \
      "(the venv $VENV: $VENV_MIB unless set up already; $TMP: $TMP_MIB)" >&2
    exit 1
  fi
done
bash scripts/setup.sh --llm  # the suites cover the LLM half (lm-eval task pools, the offline LLM world)
# Bytecode for what only the tests import (setup.sh compiles what the product imports): once, not in every process.
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHON="$VENV/bin/python"
status=0
for suite in tests experiments/tests; do
  echo "== $suite"
  rc=0
  "$PYTHON" -m pytest -q -n "${FEATCAL_TEST_WORKERS:-auto}" "$suite" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then rc=0; fi  # no test selected in this suite
  if [ "$rc" -ne 0 ]; then status=$rc; fi
done
exit "$status"
