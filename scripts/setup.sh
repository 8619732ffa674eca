#!/usr/bin/env bash
# Create .venv (or $FEATCAL_VENV) and install the product (featcal-fusionbench) and the experiments
# (experiments/: featcal-experiments, the offline worlds and their data) with the exact versions in constraints.txt.
# Idempotent: a second run only checks. Re-run after adding a new module (the editable installs are link trees).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FEATCAL_VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# strict editable mode: Hydra finds our search-path plugin (a namespace package) only this way.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt \
  -e '.[test]' -e ./experiments --config-settings editable_mode=strict 2>&1 | { grep -v "^WARNING: Location" || true; }
bash experiments/scripts/install_world_data.sh
"$VENV/bin/python" -c "import featcal_fusionbench, featcal_experiments, fusion_bench, torch; print('featcal-fusionbench', featcal_fusionbench.__version__, '| torch', torch.__version__)"
