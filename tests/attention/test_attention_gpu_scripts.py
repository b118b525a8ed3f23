"""The GPU check's scripts run their CPU mode: the kernel-efficiency benchmark (every method's simulated schedule,
checked against single-device attention) and the torchrun multi-process check (gloo instead of NCCL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # torchrun-style scripts in CPU mode

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_gpu_benchmark_cpu_mode(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_attention

    out = tmp_path / "g.json"
    res = gpu_attention.main(["--device", "cpu", "--tiny", "--worlds", "2", "--reps", "0", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["tokens"] == res["tokens"] and {r["method"] for r in saved["runs"]} == {"ring", "allgather", "ulysses"}
    assert all(r["exact"] and r["efficiency"]["fwd"] > 0 for r in saved["runs"])


def test_torchrun_check_cpu_mode():
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tools", "nccl_check.py"), "--device", "cpu"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count(" ok") == 2 * 3 * 2  # ranks x methods x masks
