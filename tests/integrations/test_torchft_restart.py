"""Without torchft: a run killed on N processes restarts on M from its last checkpoint, every document of the epoch
exactly once. examples/elastic_restart.py runs under torchrun's elastic agent, three nodes (agents) with one
process each on gloo; after step 5 the last node dies (its agent and its worker, SIGKILL), the other agents
restart their workers on two nodes, which load the last checkpoint (step 4) and plan the rest of the window for
dp=2. BalancedTrainer's resume onto another topology: tests/training/test_trainer_resume.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_elastic_restart_from_3_to_2_processes_every_document_once(tmp_path):
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    from elastic_restart import lengths_of

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # the rendezvous, outside the nodes
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "log").mkdir()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"localhost:{store.port}", "--rdzv-id", "t", "--rdzv-conf",
           "is_host=false,join_timeout=60,last_call_timeout=2",
           "--max-restarts", "3", "--monitor-interval", "0.2", str(ROOT / "examples" / "elastic_restart.py"),
           "--ckpt", str(tmp_path / "ckpt"), "--trace", str(tmp_path / "log"), "--die-at", "5"]  # fmt: skip
    outs = [open(tmp_path / f"agent{i}.out", "w") for i in range(3)]
    agents = [subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=subprocess.STDOUT) for o in outs]
    try:
        codes = sorted(a.wait(timeout=300) for a in agents)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    tail = "".join((tmp_path / f"agent{i}.out").read_text()[-2000:] for i in range(3))
    assert codes == [-9, 0, 0], tail  # one node died, the two others finished the epoch
    lines = [json.loads(x) for f in sorted((tmp_path / "log").glob("*.jsonl")) for x in f.read_text().splitlines()]
    first = [r for r in lines if r["restart"] == 0]
    second = [r for r in lines if r["restart"] == max(x["restart"] for x in lines)]  # the run that finished
    assert {r["world"] for r in first} == {3} and {r["world"] for r in second} == {2}, tail
    resumed_at = min(r["step"] for r in second) - 1  # the checkpoint's step
    assert resumed_at == 4 and max(r["step"] for r in first) == 5  # step 5 ran, was lost with the node, and re-done
    lengths = lengths_of(400)
    offset = np.concatenate([[0], np.cumsum(lengths)])
    seen = np.zeros(int(offset[-1]), dtype=np.int64)
    for r in [r for r in first if r["step"] <= resumed_at] + second:
        for mb in r["mbs"]:
            for p in mb:
                d, a, b = (p[0], 0, int(lengths[p[0]])) if len(p) == 1 else p
                seen[offset[d] + a : offset[d] + b] += 1
    assert seen.min() == 1 and seen.max() == 1
