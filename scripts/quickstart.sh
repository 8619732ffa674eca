#!/usr/bin/env bash
# The main job: set up, build the default offline world if absent, then run Task Arithmetic and
# Task Arithmetic + FeatCal through the fusion_bench CLI and print their accuracies side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FEATCAL_VENV:-.venv}
WORLD_NAME=${FEATCAL_WORLD:-clip}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORLD=$("$VENV/bin/featcal-world" path "$WORLD_NAME" --build)
read -r -a WORLD_ARGS <<< "$("$VENV/bin/featcal-world" args "$WORLD_NAME")"
OUT=${FEATCAL_OUT:-outputs/quickstart/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$OUT"
echo "world: $WORLD"
echo "log:   $OUT/run.log"
( cd "$OUT" && "$OLDPWD/$VENV/bin/fusion_bench" "${WORLD_ARGS[@]}" \
    method=featcal method.num_calibration_examples=64 method.return_upstream=true path.log_dir=. "$@" ) > "$OUT/run.log" 2>&1 \
  || { tail -40 "$OUT/run.log"; exit 1; }
"$VENV/bin/python" -m featcal_fusionbench.reporting "$OUT/program_report.json"
