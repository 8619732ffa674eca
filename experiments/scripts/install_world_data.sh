#!/usr/bin/env bash
# Packaged real data for the offline worlds from Debian (no hub); the PyPI ones are featcal-experiments' dependencies.
# Installing them needs root (apt-get); with every package present nothing is asked. Without root (or apt-get) and
# with packages missing it prints one line, the command to run as root with the packages it installs, and exits 1.
#   --check  only say whether setup can go on: exit 0 when every package is present or this shell can install them
set -euo pipefail
DEBIAN_PACKAGES=(dataset-fashion-mnist openclipart-png fonts-dejavu-core fonts-liberation fonts-urw-base35 fonts-freefont-ttf fontconfig
  fortunes fortunes-min fortunes-de fortunes-es fortunes-it fortunes-pl fortunes-ru fortunes-cs fortunes-br fortunes-ga
  fortunes-eo fortunes-bg)
missing=()
for p in "${DEBIAN_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "the offline worlds' data need Debian packages that are not installed; as root, run:" \
    "apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 1
fi
if [ "${1:-}" = --check ]; then
  exit 0
fi
echo "installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
