#!/usr/bin/env bash
# The main job: set up, build the default offline world if absent, then run Task Arithmetic, Task Arithmetic + FeatCal
# (the paper's values, and lambda / rho chosen without labels: method=featcal/auto_clip_ta) and Task Arithmetic +
# Surgery through the fusion_bench CLI and print their accuracies, one row each (featcal-report compare), and the path
# of FeatCal's drift picture.
# Default world: `clip-quick` (four real packaged tasks; built in minutes on 2 CPU cores, see experiments/docs/offline_world.md).
# FEATCAL_WORLD=clip runs the full eight-task world instead (built once in about an hour), FEATCAL_WORLD=toy the
# synthetic smoke world. Extra arguments go to the two FeatCal runs (e.g. method.seed=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FEATCAL_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV=$PWD/$VENV ;; esac
WORLD_NAME=${FEATCAL_WORLD:-clip-quick}
N=64  # calibration examples per task, FeatCal and Surgery alike
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORLD=$("$VENV/bin/featcal-world" path "$WORLD_NAME" --build)
read -r -a WORLD_ARGS <<< "$("$VENV/bin/featcal-world" args "$WORLD_NAME")"
OUT=${FEATCAL_OUT:-outputs/quickstart/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$OUT/featcal" "$OUT/auto" "$OUT/surgery"
echo "world: $WORLD"
echo "log:   $OUT/run.log"
( cd "$OUT/featcal" && "$VENV/bin/fusion_bench" "${WORLD_ARGS[@]}" \
    method=featcal method.num_calibration_examples=$N method.return_upstream=true method.track_upstream_drift=true \
    path.log_dir=. "$@" ) > "$OUT/run.log" 2>&1 \
  && ( cd "$OUT/auto" && "$VENV/bin/fusion_bench" "${WORLD_ARGS[@]}" \
    method=featcal/auto_clip_ta method.num_calibration_examples=$N method.track_upstream_drift=true path.log_dir=. "$@" ) >> "$OUT/run.log" 2>&1 \
  && ( cd "$OUT/surgery" && "$VENV/bin/fusion_bench" "${WORLD_ARGS[@]}" \
    method=surgery/clip_ta method.num_calibration_examples=$N method.precompute_features=true path.log_dir=. ) >> "$OUT/run.log" 2>&1 \
  || { tail -40 "$OUT/run.log"; exit 1; }
"$VENV/bin/featcal-report" compare "$OUT/featcal" "$OUT/auto" "$OUT/surgery" --out "$OUT"
echo "drift per block of TA + FeatCal: $OUT/featcal/featcal_drift.png"
