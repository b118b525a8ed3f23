"""A pretokenized folder of 600+ shards under `ulimit -n 1024`: pretokenize writes it, then it opens, plans (CLI),
packs (CLI) and trains (ShardDataset + BalancedBatchSampler + PackedCollator + an optimizer step per micro-batch)
with the descriptor count flat. Before, every mapped index and Arrow file kept a descriptor, so opening the folder
stopped at about the 340th shard with "Too many open files"."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 640

CHILD = r"""
import json, os, sys
from pathlib import Path
import numpy as np
import torch
import balancer
from balancer.cli import main

tmp = Path(sys.argv[1])
fds = lambda: len(os.listdir("/proc/self/fd"))
src = tmp / "in.jsonl"
src.write_text("".join(json.dumps({"text": "w " * (30 + i % 40)}) + "\n" for i in range(int(sys.argv[2]))))
assert main(["pretokenize", str(src), "--output", str(tmp / "tok"), "--shard-tokens", "1"]) == 0
start = fds()
ds = balancer.ShardDataset(tmp / "tok")
shards = len(json.loads((tmp / "tok" / "manifest.json").read_text())["shards"])
assert main(["plan", str(tmp / "tok"), "--dp", "2", "--micro-batches", "2", "--max-tokens", "512",
             "-o", str(tmp / "plan.json"), "--no-baseline"]) == 0
assert main(["pack", str(tmp / "tok"), "--output", str(tmp / "packed"), "--dp", "2", "--micro-batches", "2",
             "--max-tokens", "512"]) == 0
topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=512)
cost = balancer.CostModel(attn_coef=1e-3, linear_coef=1.0)
sampler = balancer.BalancedBatchSampler(ds.lengths, topo, cost, dp_rank=0, seed=0)
loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=balancer.PackedCollator(0, 1))
model = torch.nn.Sequential(torch.nn.Embedding(512, 8), torch.nn.Linear(8, 512))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tokens = 0
for batch in loader:
    logits = model(batch["input_ids"])
    loss = balancer.loss.token_loss(logits, batch["labels"], reduction="sum")
    loss.backward(); opt.step(); opt.zero_grad()
    tokens += int(batch["input_ids"].numel())
print(json.dumps({"shards": shards, "rows": len(ds), "tokens": tokens, "total": int(ds.lengths.sum()),
                  "fds_start": start, "fds_end": fds()}))
"""


@pytest.mark.slow  # pretokenize writes 640 shards (~2-4 minutes on 2 shared cores)
def test_six_hundred_shards_open_plan_pack_and_train_under_ulimit_1024(tmp_path):
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(SHARDS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=limit,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shards"] >= 600 and result["rows"] == SHARDS
    assert result["tokens"] == result["total"]  # every token trained once (one CP rank: nothing cut away)
    assert result["fds_end"] - result["fds_start"] < 50, result  # no descriptor per shard
