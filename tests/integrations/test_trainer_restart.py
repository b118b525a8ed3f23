"""BalancedTrainer killed on 3 processes and restarted on 2 from its last checkpoint, every document of the epoch
exactly once (examples/trainer_restart.py under torchrun, a tiny Llama from its config, gloo): the first launch
saves a checkpoint every 2 optimizer steps and its last rank dies (SIGKILL) at the end of step 5, which stops the
job; the relaunch on 2 processes resumes from checkpoint-4 with `resume_from_checkpoint`, its sampler planning the
rest of the epoch for dp=2. The tokens of the first launch's steps up to the checkpoint and of every step of the
relaunch add up to every document's length, each once (document d's tokens are all d + 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def _launch(tmp_path: Path, nproc: int, *extra: str) -> tuple[int, str]:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
           str(ROOT / "examples" / "trainer_restart.py"), "--out", str(tmp_path / "run"),
           "--trace", str(tmp_path / "trace"), *extra]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420, env=env)
    return out.returncode, (out.stdout + out.stderr)[-4000:]


def test_balanced_trainer_killed_on_3_restarts_on_2_every_document_once(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from trainer_restart import lengths_of

    (tmp_path / "trace").mkdir()
    code, tail = _launch(tmp_path, 3, "--die-at", "5")
    assert code != 0, tail  # the job stopped with its worker
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))[-1] == "checkpoint-4", tail
    code, tail = _launch(tmp_path, 2, "--resume")
    assert code == 0, tail
    lines = [json.loads(x) for f in sorted((tmp_path / "trace").glob("*.jsonl")) for x in f.read_text().splitlines()]
    first = [r for r in lines if r["world"] == 3]
    second = [r for r in lines if r["world"] == 2]
    assert max(r["step"] for r in first if r["rank"] == 2) == 5  # step 5 ran on every rank, then was lost
    assert min(r["step"] for r in second) == 5  # and was trained again after the restart
    seen: Counter = Counter()
    for r in [r for r in first if r["step"] <= 4] + second:
        seen.update({int(d): n for d, n in r["tokens"].items()})
    lengths = lengths_of(240)
    assert -1 not in seen  # no padding token (0) among the trained tokens
    assert dict(seen) == {d: int(n) for d, n in enumerate(lengths)}  # every document's tokens, each once
