#!/usr/bin/env bash
# A venv of mergekit's own, as users run it: mergekit 0.1.5 needs transformers>=5,<6 while .venv pins transformers 4.x.
#   bash experiments/scripts/mergekit_setup.sh            # venv at ${MERGEKIT_VENV:-.venv-mergekit}, repo-relative
# A second run only checks the pins and prints the versions. PYTHON picks the interpreter (>=3.10, mergekit's floor).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${MERGEKIT_VENV:-.venv-mergekit}
PY=${PYTHON:-python3}
# Exact versions this script was verified with. torch: a CPU build (mergekit merges on CPU unless --cuda; PyPI's Linux
# torch pulls ~3 GB of CUDA wheels). The rest: the resolution of `pip install mergekit==0.1.5` at the time, pinned so
# the merge we calibrate does not change under us.
TORCH=2.13.0
PINS=(mergekit==0.1.5 transformers==5.24.0 safetensors==0.8.0 tokenizers==0.23.3 huggingface_hub==2.4.0
  accelerate==1.15.0 peft==0.21.2 "torch==$TORCH")

versions() {
  "$VENV/bin/python" - "$@" <<'EOF'
import importlib.metadata as m, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(" ".join(f"{k} {version(k)}" for k in ("mergekit", "transformers", "torch")))
# torch's local label (+cpu) is not part of the pin.
sys.exit(any((version(k) or "").split("+")[0] != v for k, v in (a.split("==") for a in sys.argv[1:])))
EOF
}

if [ -x "$VENV/bin/mergekit-yaml" ] && versions "${PINS[@]}" >/dev/null 2>&1; then
  echo "mergekit venv $VENV is ready: $(versions)"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# The CPU index only where it answers (offline mirrors and closed networks do not); there `torch==$TORCH` from the
# configured indexes, which may still be a CUDA build.
CPU_INDEX=https://download.pytorch.org/whl/cpu
if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "torch==$TORCH" --extra-index-url "$CPU_INDEX"
else
  echo "download.pytorch.org unreachable: torch==$TORCH from the configured indexes"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH"
fi
# torch is in PINS so the resolver cannot swap the CPU build for another.
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
versions "${PINS[@]}" || { echo "mergekit venv $VENV does not match the pins above" >&2; exit 1; }
