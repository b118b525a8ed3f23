#!/usr/bin/env bash
# Create .venv (once) and install the toolkit into it. Usage: tools/setup.sh [EXTRAS], e.g. tools/setup.sh test
# torch: the CPU build 2.13.0 is installed when no torch is importable (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    "$VPY" -m pip install --quiet "torch==2.13.0"
fi
SPEC="."
if [ -n "$EXTRAS" ]; then SPEC=".[$EXTRAS]"; fi
"$VPY" -m pip install --quiet -e "$SPEC"
