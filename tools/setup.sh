#!/usr/bin/env bash
# Create .venv (once) and install the toolkit into it. Usage: tools/setup.sh [EXTRAS], e.g. tools/setup.sh test
# torch: the CPU build 2.13.0 is installed when no torch is importable (an unpinned torch pulls a multi-GB CUDA build).
# On a terminal every stage is announced and pip shows its progress bars; without one (CI, logs) it stays quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ -t 1 ]; then
    PIP_OUT=(--progress-bar on)
    say() { echo "setup: $*"; }
else
    PIP_OUT=(--quiet)
    say() { :; }
fi
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $PY"
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    say "installing torch 2.13.0, CPU build (about 200 MB; a minute or so)"
    "$VPY" -m pip install "${PIP_OUT[@]}" "torch==2.13.0"
fi
SPEC="."
if [ -n "$EXTRAS" ]; then SPEC=".[$EXTRAS]"; fi
say "installing seqbalancer $SPEC (editable) and its dependencies"
"$VPY" -m pip install "${PIP_OUT[@]}" -e "$SPEC"
if [[ ",$EXTRAS," == *",test,"* || ",$EXTRAS," == *",peers,"* ]]; then  # peers: benchmarks/peers_pkg.py
    # verl 0.9.1's metadata pins transformers<5.11 (the project needs 5.x beyond that) and ray[default], wandb,
    # tensorboard...: installed beside the resolver with --no-deps, plus what its DataProto and seqlen_balancing import
    # (tensordict and its dependencies, omegaconf are in the test extras). balancer.integrations.verl's tests skip,
    # naming the reason, when verl cannot be imported.
    say "installing verl 0.9.1 (--no-deps) for balancer.integrations.verl"
    "$VPY" -m pip install "${PIP_OUT[@]}" --no-deps "verl==0.9.1" "tensordict==0.10.0"
fi
if [[ ",$EXTRAS," == *",test,"* ]]; then
    # torchtitan 0.3.0 (balancer.integrations.torchtitan): its metadata pins datasets<4.8 (the project runs datasets
    # 5.x) and pulls wandb, torch_checkpointing...: installed beside the resolver with --no-deps; what its data loader,
    # llama3 model and Trainer import (spmd_types, tyro, einops, triton, tensorboard) is in the test extras. Its tests
    # skip, naming the reason, when torchtitan cannot be imported.
    say "installing torchtitan 0.3.0 (--no-deps) for balancer.integrations.torchtitan"
    "$VPY" -m pip install "${PIP_OUT[@]}" --no-deps "torchtitan==0.3.0"
fi
if [[ ",$EXTRAS," == *",test,"* ]]; then  # megatron: balancer.integrations.megatron, its tests and benchmark
    # megatron-core 0.19.2 declares Python >= 3.12 (cp312 wheel only) but its sdist installs and runs on 3.11; extras
    # cannot carry --ignore-requires-python. Beside it only what its imported modules need: triton (imported at
    # module level by megatron.core) and einops. --no-deps: no other package's version changes.
    say "installing megatron-core 0.19.2 (--no-deps) for balancer.integrations.megatron"
    "$VPY" -m pip install "${PIP_OUT[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2" \
        "triton==3.9.0" "einops==0.8.2"
fi
say "done: .venv/bin/balancer --help"
