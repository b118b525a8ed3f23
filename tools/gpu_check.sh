#!/usr/bin/env bash
# GPU check for attention/ (never run by CI), one call on one GPU, under 8 minutes (the step limits sum to 460 s):
#   1. the interpreter: the first of $PY, .venv/bin/python, python3, python whose torch is a CUDA build that sees a GPU
#      (a CPU-only virtualenv is never picked); device, torch, flash-attn versions and `python -m attention.backends`;
#   2. the CUDA tests (tests/attention/test_attention_gpu.py): PyTorch's flash kernel in bf16/fp16 with windows, GQA,
#      tall windowed blocks, every CP schedule simulated on the device; flash-attn 2/3 when installed;
#   3. the kernel-faithful CPU stand-in tests (the same schedules through every binding's recorded signature);
#   4. the kernel-efficiency benchmark (benchmarks/gpu_attention.py, every method, W = 2, 4, 8, plus a windowed run);
#   5. with 2+ GPUs, the torchrun NCCL check (tools/nccl_check.py).
# Every step runs even when one fails; a summary ends the log. The log and benchmarks/results/gpu_attention.json are
# also copied to $OUT when that variable is set. Exit status: 0 when every step passed, 1 otherwise.
# Usage: tools/gpu_check.sh            (PY=/path/to/python to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="$(mktemp -t gpu_check.XXXXXX.log)"
exec > >(tee "$LOG") 2>&1
START=$(date +%s)
declare -a NAMES RESULTS

pick_python() {
  for cand in "${PY:-}" .venv/bin/python python3 python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
    if "$cand" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1; then
      echo "$cand"; return 0
    fi
    echo "skipping interpreter $cand: its torch is not a CUDA build that sees a GPU" >&2
  done
  return 1
}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, record pass/fail, never stop the script
  local name="$1" limit="$2"; shift 2
  echo; echo "=== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=20 "$limit" "$@"
  local rc=$?
  NAMES+=("$name"); RESULTS+=("rc=$rc $(( $(date +%s) - t0 ))s")
  return 0
}

PYBIN="$(pick_python)" || { echo "no Python with a CUDA build of torch and a visible GPU; set PY=..."; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "interpreter: $PYBIN"
step "environment" 30 "$PYBIN" - <<'PYEOF'
import importlib.metadata as md
import torch
print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
      "torch", torch.__version__, "CUDA", torch.version.cuda,
      "flash kernels built:", torch.backends.cuda.is_flash_attention_available())
for dist in ("flash-attn", "flash_attn_3"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
PYEOF
step "backends report" 30 "$PYBIN" -m attention.backends
step "CUDA tests" 170 "$PYBIN" -m pytest -q -rs -p no:cacheprovider tests/attention/test_attention_gpu.py
step "stand-in tests" 90 "$PYBIN" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/attention/test_attention_backends.py tests/attention/test_attention_flash_schedules.py
step "benchmark" 140 "$PYBIN" benchmarks/gpu_attention.py --backend auto --reps 2
NGPU="$("$PYBIN" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if [ "$NGPU" -ge 2 ]; then
  step "NCCL torchrun" 120 "$PYBIN" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" tools/nccl_check.py
else
  echo; echo "one GPU: the NCCL test (tools/nccl_check.py under torchrun) needs 2+ GPUs; skipped"
fi

echo; echo "=== summary ($(( $(date +%s) - START ))s in all)"
FAILED=0
for i in "${!NAMES[@]}"; do
  case "${RESULTS[$i]}" in rc=0\ *) state="PASS" ;; *) state="FAIL"; FAILED=1 ;; esac
  printf '%-18s %s (%s)\n' "${NAMES[$i]}" "$state" "${RESULTS[$i]}"
done
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  [ -f benchmarks/results/gpu_attention.json ] && cp benchmarks/results/gpu_attention.json "$OUT/"
  echo "log and results copied to $OUT"
  sleep 1; cp "$LOG" "$OUT/gpu_check.log"
fi
exit "$FAILED"
