#!/usr/bin/env bash
# Packaged real data for the offline worlds from Debian (no hub); the PyPI ones are featcal-experiments' dependencies.
# Needs root for apt-get.
set -euo pipefail
DEBIAN_PACKAGES=(dataset-fashion-mnist openclipart-png fonts-dejavu-core fonts-liberation fonts-urw-base35 fonts-freefont-ttf fontconfig
  fortunes fortunes-min fortunes-de fortunes-es fortunes-it fortunes-pl fortunes-ru fortunes-cs fortunes-br fortunes-ga
  fortunes-eo fortunes-bg)
missing=()
for p in "${DEBIAN_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install these Debian packages (as root): ${missing[*]}" >&2; exit 1
  fi
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
