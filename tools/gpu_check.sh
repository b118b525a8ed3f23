#!/usr/bin/env bash
# GPU check for attention/: the CUDA tests, then the GPU benchmark. Single GPU, under 8 minutes.
# flash-attn may be absent: the torch backend on CUDA is checked either way. Usage: tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device"
print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
try:
    import flash_attn
    print("flash_attn", getattr(flash_attn, "__version__", "?"))
except Exception as e:
    print("flash_attn: not available:", type(e).__name__)
PYEOF
timeout 300 "$PY" -m pytest -q -rs tests/test_attention_gpu.py
timeout 150 "$PY" benchmarks/gpu_attention.py
