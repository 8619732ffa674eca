#!/usr/bin/env bash
# How FeatCal's calibration cost grows with batch size, n, the number of tasks N and the model's width,
# one bench_calibration.py run per point (each JSON names its command, machine and date).
#   bash experiments/scripts/bench_scaling.sh cuda experiments/results/benchmarks/scaling_cuda [points...]
# Points: bs64 bs128 n32 n64 n128 n512 t2 t4 tiny small l14 (default: all). Batch 128 except the bs points.
set -euo pipefail
device=${1:?device (cpu or cuda)}; out=${2:?output folder}; shift 2
points=${*:-bs64 bs128 n32 n64 n128 n512 t2 t4 tiny small l14}
PY=${PYTHON:-python}
mkdir -p "$out"
for point in $points; do
  arch=clip-vit-base-patch32; tasks=8; n=256; bs=128
  case $point in
    tiny|small) arch=$point ;;
    l14) arch=clip-vit-large-patch14 ;;
    bs*) bs=${point#bs} ;;
    n*) n=${point#n} ;;
    t*) tasks=${point#t} ;;
    *) echo "unknown point $point" >&2; exit 2 ;;
  esac
  echo "== $point: $arch, $tasks tasks, n=$n, batch $bs"
  "$PY" experiments/scripts/bench_calibration.py --arch $arch --tasks $tasks --n $n --batch-size $bs --methods featcal \
    --device "$device" --profile --json "$out/${point}.json"
done
