"""What recording a run's progress costs per shard, at 100 and 1,000 shards, for pretokenize, merge and pack.

A fresh child process runs one command on synthetic data (the byte tokenizer, one small document after another)
that makes exactly N shards, and times every call that records progress: each write of the run state
(`atomic_write_json` onto the state file, wherever the tree calls it: the pipeline, merge, pack or the journal
module) and the state journal's `append` where the tree has one; process CPU and wall clock, summed, divided by the
shards. The shard files themselves, the manifest and the data the command reads are not in the figure. pretokenize
cuts a corpus of 4N documents into N shards; merge joins the two `--num-shards 2` slices of such a corpus (N shards
in all; the slices are made before the clock runs); pack writes N documents of one source folder as N rows, one per
shard (dp 1, one micro-batch, `shard_tokens` 1). The folders are on `--dir` (default /dev/shm, a tmpfs: fsync costs
nothing there, so the figures are the recording's own work, which grows with the shards, not the disk's latency,
which does not). `--before DIR` runs the same children on another source tree (e.g. `git archive <commit> | tar -x
-C DIR`) in paired alternating repetitions. Writes benchmarks/results/state_writes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOC_WORDS = 30  # ~180 byte tokens per document
DOCS_PER_SHARD = 4
COMMANDS = ("pretokenize", "merge", "pack")
STATE_NAMES = (".pretokenize-state.json", ".pack-state.json")


def _time_recording(spent: dict) -> None:
    """Wrap, in the modules of this tree, every call that records progress so that it adds its time to `spent`."""
    import importlib

    def timed(fn, state_only: bool):
        def run(*a, **k):
            if state_only and Path(a[0]).name not in STATE_NAMES:  # the manifest, dataset_info.json: not progress
                return fn(*a, **k)
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["cpu"] += time.process_time() - c
                spent["wall"] += time.perf_counter() - w
                spent["calls"] += 1

        return run

    for name in ("pretokenize.pipeline", "pretokenize.merge", "pack.build", "shards.journal"):
        module = importlib.import_module(f"balancer.data.{name}")
        if hasattr(module, "atomic_write_json"):
            module.atomic_write_json = timed(module.atomic_write_json, True)
    journal = getattr(importlib.import_module("balancer.data.pretokenize.pipeline"), "StateJournal", None)
    if journal is not None:
        journal.append = timed(journal.append, False)


def _corpus(path: Path, docs: int) -> int:
    """`docs` small documents into `path`; returns the byte tokens of one."""
    text = " ".join(["word"] * DOC_WORDS)
    with open(path, "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": f"{i} {text}"}) + "\n")
    return len(f"0 {text}".encode())


def _run(command: str, shards: int, tmp: Path, spent: dict) -> dict:
    """Prepare the inputs of `command`, then time its recording (`spent`) over one run; returns its manifest."""
    from balancer.data.pretokenize import pipeline
    from balancer.data.pretokenize.options import PretokenizeOptions

    def tokenize(docs: int, out: Path, **kw) -> dict:
        tokens = _corpus(tmp / "c.jsonl", docs) * DOCS_PER_SHARD
        opts = PretokenizeOptions(shard_tokens=tokens - 10)
        return pipeline.pretokenize([str(tmp / "c.jsonl")], out, options=opts, progress=False, **kw)

    if command == "pretokenize":
        _time_recording(spent)
        return tokenize(shards * DOCS_PER_SHARD, tmp / "tok")
    if command == "merge":
        from balancer.data.pretokenize.merge import merge

        parts = [tmp / "p0", tmp / "p1"]
        for i, part in enumerate(parts):
            tokenize(shards * DOCS_PER_SHARD, part, num_shards=2, shard_index=i)
        _time_recording(spent)
        return merge([str(p) for p in parts], tmp / "merged")
    import balancer
    from balancer.data.pack.build import pack

    tokenize(shards, tmp / "tok")
    topology = balancer.Topology(dp=1, cp=1, micro_batches=1, max_tokens=256)
    cost = balancer.CostModel(attn_coef=1 / 3000, linear_coef=1.0)
    _time_recording(spent)
    return pack(tmp / "tok", tmp / "packed", topology, cost, shard_tokens=1, progress=False)


def child(command: str, shards: int, where: str) -> dict:
    """Runs in a fresh process (the tree on PYTHONPATH): one `command` run of `shards` shards, its recording timed."""
    spent = {"cpu": 0.0, "wall": 0.0, "calls": 0}
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        t0 = time.perf_counter()
        manifest = _run(command, shards, Path(tmp), spent)
        total = time.perf_counter() - t0
    made = len(manifest["shards"])
    return {
        "shards": made,
        "record_calls": spent["calls"],
        "record_cpu_ms_per_shard": round(1000 * spent["cpu"] / made, 4),
        "record_wall_ms_per_shard": round(1000 * spent["wall"] / made, 4),
        "run_wall_seconds": round(total, 2),
    }


def run_child(tree: str, command: str, shards: int, where: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", command, str(shards), "--dir", where]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _medians(runs: dict) -> dict:
    """command -> tree -> shards -> the median of each per-shard figure over the repetitions."""
    return {
        command: {
            name: {
                n: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0] if k.startswith("record_") and "ms" in k}
                for n, rs in per.items()
            }
            for name, per in trees.items()
        }
        for command, trees in runs.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[100, 1000], help="shard counts to run")
    ap.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS), help="the commands to time")
    ap.add_argument("--repeats", type=int, default=2, help="paired repetitions")
    ap.add_argument("--before", help="another source tree to run the same child on (alternating)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where the folders go")
    ap.add_argument("--child", nargs=2, metavar=("COMMAND", "SHARDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.dir)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import table, write_result

    here = str(Path(__file__).resolve().parent.parent)
    trees = {"after": here} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    runs = {c: {name: {n: [] for n in args.shards} for name in trees} for c in args.commands}
    for r in range(args.repeats):
        for command in args.commands:
            for n in args.shards:
                for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                    res = run_child(trees[name], command, n, args.dir)
                    runs[command][name][n].append(res)
                    print(command, name, n, res, flush=True)
    median = _medians(runs)
    labels = {"after": "this tree", "before": args.before or ""}
    rows = [
        [command, labels[name], f"{n:,}", f"{m['record_cpu_ms_per_shard']:.3f} ms",
         f"{m['record_wall_ms_per_shard']:.3f} ms", str(runs[command][name][n][0]["record_calls"])]
        for command, per_tree in median.items() for name, per in per_tree.items() for n, m in per.items()
    ]  # fmt: skip
    columns = ["command", "code", "shards", "recording CPU per shard", "recording wall per shard", "recording calls"]
    result = {"dir": args.dir, "runs": runs, "median": median, "tables": {"per_shard": table(columns, rows)}}
    print("median:", median)
    print("wrote", write_result("state_writes", result, clock="process_cpu"))


if __name__ == "__main__":
    main()
