"""Does a world that stops a BalancedStream early exit cleanly? (0 aborts in 50 runs, at 2 and 4 ranks.)

The world: `--ranks` processes (spawned Python processes, gloo, a TCP rendezvous), each reading one Hugging Face
streaming JSON dataset through `BalancedStream` and a `DataLoader`, breaking after 37 micro-batches (mid-window:
the next window's read, gather, plan and exchange is in flight on the stream's thread), then
`destroy_process_group()` and a normal exit, without `close()`. A run is clean when every process exits 0; an abort
is a process killed by a signal (SIGABRT: "terminate called without an active exception") or any other non-zero exit.
"baseline" is the same world reading the same dataset without the stream (`split_dataset_by_node`); "before" is the
stream world on git revision `--ref` (the tree before the stream's teardown, extracted into a temporary folder).
The variants alternate run by run; "after" is the committed HEAD (extracted like "before").
Writes benchmarks/results/stream_exit.json (clock: wall, the run times are only
reported, nothing is timed against anything).

Run: `python benchmarks/stream_exit.py` (50 runs of each variant at 2 and 4 ranks; about 30 minutes on 2 shared
cores); `--runs 5 --variants after` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BREAK_AFTER = 37  # micro-batches read before the break
# the commit "after" measures (resolved once: others may commit while it runs)
HEAD_AT_START = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()

CHILD = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
import datasets
data = datasets.load_dataset("json", data_files=sys.argv[1], split="train", streaming=True)
variant, stop = sys.argv[2], int(sys.argv[3])
if variant == "baseline":
    from datasets.distributed import split_dataset_by_node
    items = iter(split_dataset_by_node(data, rank=rank, world_size=world))
else:
    import torch
    import balancer
    topo = balancer.Topology(dp=world, micro_batches=2, max_tokens=512)
    stream = balancer.BalancedStream(data, topo, balancer.CostModel(attn_coef=1e-4, linear_coef=1.0),
                                     window_docs=512, dp_rank=rank, seed=0)
    items = iter(torch.utils.data.DataLoader(stream, batch_size=None, collate_fn=lambda rows: rows))
for i, _ in enumerate(items):
    if i + 1 >= stop:
        break
dist.destroy_process_group()
"""


def write_dataset(folder: Path, docs: int = 4000) -> Path:
    """A JSON-lines corpus of `docs` documents (lengths 1..299, a fixed seed)."""
    import numpy as np

    rng = np.random.default_rng(0)
    path = folder / "corpus.jsonl"
    with open(path, "w") as f:
        for d in range(docs):
            f.write(json.dumps({"input_ids": list(range(d % 7, d % 7 + int(rng.integers(1, 300))))}) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(tree: Path, data: Path, variant: str, ranks: int, timeout: float = 300.0) -> dict:
    """One world: every process's exit code (negative: killed by that signal) and its stderr's last line."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks))
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    procs = []
    started = time.perf_counter()
    for r in range(ranks):
        env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, "-c", CHILD, str(data), variant, str(BREAK_AFTER)]
        procs.append(subprocess.Popen(cmd, env=env_r, cwd=tree, stderr=subprocess.PIPE, text=True))
    codes, last = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += "\n(timed out)"
        codes.append(p.returncode)
        lines = [line for line in err.splitlines() if line.strip()]
        last.append(lines[-1][:200] if lines else "")
    clean = all(c == 0 for c in codes)
    return {"codes": codes, "clean": clean, "seconds": time.perf_counter() - started, "stderr": [] if clean else last}


def extract(ref: str, into: Path) -> Path:
    """The `balancer` and `attention` packages of git revision `ref`, written under `into`."""
    data = subprocess.run(
        ["git", "archive", ref, "balancer", "attention"], cwd=REPO, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def measure(runs: int, ranks_list: list[int], variants: list[str], ref: str) -> list[dict]:
    """Every variant's runs at every world size, the variants alternating run by run; a summary row each."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = write_dataset(Path(tmp))
        # committed trees (HEAD and --ref), never the working tree: edits made while it runs change nothing
        trees = {"after": extract(HEAD_AT_START, Path(tmp) / "after")}
        trees["baseline"] = trees["after"]
        if "before" in variants:
            trees["before"] = extract(ref, Path(tmp) / "before")
        for ranks in ranks_list:
            results: dict[str, list[dict]] = {v: [] for v in variants}
            for _ in range(runs):
                for v in variants:
                    results[v].append(run_world(trees[v], data, "baseline" if v == "baseline" else "stream", ranks))
            for v in variants:
                done = results[v]
                aborts = [r for r in done if not r["clean"]]
                row = {
                    "variant": v,
                    "ranks": ranks,
                    "runs": len(done),
                    "clean": len(done) - len(aborts),
                    "aborted": len(aborts),
                    "signals": sorted({-c for r in aborts for c in r["codes"] if c < 0}),
                    "seconds_median": sorted(r["seconds"] for r in done)[len(done) // 2],
                    "failures": [{"codes": r["codes"], "stderr": r["stderr"]} for r in aborts[:5]],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="runs of every variant at every world size")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes")
    ap.add_argument("--variants", nargs="+", default=["after", "before", "baseline"],
                    choices=["after", "before", "baseline"])  # fmt: skip
    ap.add_argument("--ref", default="62295f4", help="git revision of the 'before' tree (before the teardown)")
    args = ap.parse_args()
    rows = measure(args.runs, args.ranks, args.variants, args.ref)
    commit = HEAD_AT_START  # the committed tree measured (never the working tree)
    dirty = False
    goal = all(r["aborted"] == 0 for r in rows if r["variant"] == "after")
    payload = {"commit": commit, "tree_modified": dirty, "ref": args.ref, "break_after": BREAK_AFTER, "rows": rows,
               "goals": {"0 aborts in every run of the stream world": goal}}  # fmt: skip
    print(write_result("stream_exit", payload, clock="wall"))


if __name__ == "__main__":
    main()
