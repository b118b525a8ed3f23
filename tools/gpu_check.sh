#!/usr/bin/env bash
# GPU check for attention/ (never run by CI). Single GPU: the CUDA tests (torch CUDA backend in bf16/fp16, windows,
# flash-attn 2/3 when installed, every method's schedule simulated in one process), then the kernel-efficiency
# benchmark (bf16, every method, W = 2, 4, 8). With 2+ GPUs also a torchrun NCCL test of every method. Budget: under
# 8 minutes. Usage: tools/gpu_check.sh   (PY=/path/to/python to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device"
print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
      "torch", torch.__version__, "flash kernels built:", torch.backends.cuda.is_flash_attention_available())
for mod in ("flash_attn", "flash_attn_interface"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "(no version)"))
    except Exception as e:
        print(mod, "not available:", type(e).__name__)
PYEOF
timeout 300 "$PY" -m pytest -q -rs tests/test_attention_gpu.py
timeout 150 "$PY" benchmarks/gpu_attention.py --backend torch
NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$NGPU" -ge 2 ]; then
  timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" tools/nccl_check.py
else
  echo "one GPU: the NCCL test (tools/nccl_check.py under torchrun) needs 2+ GPUs; skipped"
fi
