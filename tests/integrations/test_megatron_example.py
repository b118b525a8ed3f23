"""examples/megatron_train.py runs standalone: a synthetic corpus pretokenized into a folder, a dynamic-CP plan, a
megatron-core GPTModel with CPCoreAttention on spawned gloo ranks, a falling loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "megatron.core", reason="megatron-core is not importable (tools/setup.sh test installs megatron-core 0.19.2)"
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_example_trains_with_dynamic_cp(tmp_path):
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, str(REPO / "examples" / "megatron_train.py"), "--dp", "2", "--cp-sizes", "1", "2"]
    cmd += ["--steps", "3", "--docs", "120", "--max-tokens", "128", "--lr", "3e-3", "--log-json", str(log)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.rstrip().endswith("done")
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == 3
    assert all(len(rec["cp_sizes"]) == rec["num_microbatches"] == 2 for rec in recs)
    assert {s for rec in recs for s in rec["cp_sizes"]} <= {1, 2}
    assert recs[-1]["loss"] < recs[0]["loss"]
