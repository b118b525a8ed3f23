"""How fast is `balancer.balance_batch` on large fixed batches, and does the near-linear path keep the quality?

GRPO-like batches (8 responses per prompt: prompts 200-1500 tokens, responses log-normal, median 1500, up to 14000)
of 1K to 128K rollouts on dp8 x max_tokens 16384 with the Qwen-7B FLOPs cost model, `micro_batches="auto"`, three
options: no groups, prompts kept on a rank (`keep="rank"`), `equal_counts=True`. Each measurement runs in a fresh
child process and times `balance_batch` alone (process CPU time), with the plan's `imbalance` (section 3: step
time over its lower bound) and micro-batch count. "before" is the same call on git revision `--ref` (the tree
before the near-linear path, extracted into a temporary folder), run only up to `--before-max` rollouts (it is
quadratic: minutes at 16K); the two alternate, repetition by repetition (paired), and the best of `--repeat` is
kept. Writes benchmarks/results/balance_batch_speed.json.

Run: `python benchmarks/balance_batch_speed.py` (about 4 minutes on 2 shared cores; `--quick`: 1K-16K, one repeat).

`--speeds`: uneven ranks, rank speeds (1.2, 1, 1, 1, 1, 1, 1, 1): every option is timed with those speeds
("after") and with even speeds on the same tree ("even", paired, alternating), and "before" is the speeds call on
`--ref` (pass the revision before the near-linear path for uneven ranks, e.g. bf59c91) up to `--before-max`
rollouts. Goals: 16K rollouts within 2x the even time, 128K within 10 s. Writes
benchmarks/results/balance_batch_speeds.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _render as tb
from _common import write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = (1024, 2048, 4096, 16384, 131072)
OPTIONS = {
    "no groups": {},
    "prompts on a rank": {"keep": "rank", "grouped": True},
    "equal_counts": {"equal_counts": True},
}
GOALS = {16384: 0.5, 131072: 5.0}  # CPU seconds (issue 28 item 8)
SPEEDS = [1.2] + [1.0] * 7  # --speeds: one faster rank
SPEED_GOALS = {16384: ("within 2x the even time", None), 131072: ("<= 10 s CPU", 10.0)}

CHILD = """
import json, sys, time
import numpy as np
import balancer
n, options = int(sys.argv[1]), json.loads(sys.argv[2])
rng = np.random.default_rng(0)
prompt = rng.integers(200, 1500, n // 8)
response = np.minimum(rng.lognormal(np.log(1500), 1.0, (n // 8, 8)), 14000).astype(np.int64) + 1
lengths = (prompt[:, None] + response).ravel()
groups = np.repeat(np.arange(n // 8), 8) if options.pop("grouped", False) else None
cost = balancer.CostModel.from_model(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                                     intermediate_size=18944, vocab_size=152064)
speeds = options.pop("speeds", None)
topo = balancer.Topology(dp=8, max_tokens=16384, rank_speeds=None if speeds is None else tuple(speeds))
started = time.process_time()
plan = balancer.balance_batch(lengths, topo, cost, groups=groups, micro_batches="auto", **options)
cpu = time.process_time() - started
plan.validate()
print(json.dumps({"cpu_seconds": cpu, "imbalance": plan.metrics()["imbalance"],
                  "micro_batches": plan.topology.micro_batches}))
"""


def run_child(tree: Path, n: int, options: dict, timeout: float) -> dict | None:
    """One measurement in a fresh process importing balancer from `tree`; None when it ran past `timeout`."""
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(n), json.dumps(options)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tree,  # the child's sys.path starts with its working folder: the tree's own balancer
            timeout=timeout,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.stdout)


def extract(ref: str, into: Path) -> Path:
    """The `balancer` package of git revision `ref`, written under `into`."""
    data = subprocess.run(["git", "archive", ref, "balancer"], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def best(runs: list[dict | None]) -> dict | None:
    done = [r for r in runs if r is not None]
    return min(done, key=lambda r: r["cpu_seconds"]) if len(done) == len(runs) and done else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="1910528", help="git revision of the 'before' tree (default: before issue 28)")
    ap.add_argument("--repeat", type=int, default=3, help="paired repetitions per case; the best is kept")
    ap.add_argument("--before-max", type=int, default=4096, help="largest batch timed on the 'before' tree")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a 'before' child may run")
    ap.add_argument("--quick", action="store_true", help="1K-16K rollouts, one repetition")
    ap.add_argument("--speeds", action="store_true", help="uneven ranks against even ones (module docstring)")
    args = ap.parse_args()
    if args.speeds:
        return main_speeds(args)
    sizes = [n for n in SIZES if not args.quick or n <= 16384]
    repeat = 1 if args.quick else args.repeat
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = extract(args.ref, Path(tmp))
        for name, options in OPTIONS.items():
            for n in sizes:
                after, before = [], []
                for _ in range(repeat):  # paired: before and after alternate
                    if n <= args.before_max:
                        before.append(run_child(before_tree, n, dict(options), args.timeout))
                    after.append(run_child(REPO, n, dict(options), 600.0))
                row = {"option": name, "rollouts": n, "after": best(after), "before": best(before) if before else None}
                if n <= args.before_max and row["before"] is None:
                    row["before_timed_out_s"] = args.timeout
                rows.append(row)
                print(json.dumps(row), flush=True)
    goals = {
        f"{n} rollouts <= {limit} s CPU": all(
            r["after"]["cpu_seconds"] <= limit for r in rows if r["rollouts"] == n and r["after"]
        )
        for n, limit in GOALS.items()
        if n in sizes
    }
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "balancer"], cwd=REPO, capture_output=True).stdout)
    payload = {
        "commit": commit,
        "tree_modified": dirty,
        "ref": args.ref,
        "repeat": repeat,
        "rows": rows,
        "goals": goals,
    }
    print(write_result("balance_batch_speed", payload, clock="process_cpu"))


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_balance_batch_speed() -> str:
    data = tb.load("balance_batch_speed")
    rows = []
    for row in data["rows"]:
        after, before = row["after"] or {}, row["before"] or {}
        rows.append(
            [
                row["option"],
                f"{row['rollouts']:,}",
                tb.fmt(after.get("cpu_seconds"), ".3f"),
                tb.fmt(before.get("cpu_seconds"), ".3f") if before else "not run (quadratic)",
                tb.fmt(after.get("imbalance") and after["imbalance"] - 1, ".1e"),
                tb.fmt(before.get("imbalance") and before["imbalance"] - 1, ".1e") if before else "-",
                f"{after.get('micro_batches', '-')} / {before.get('micro_batches', '-')}",
            ]
        )
    header = ["option", "rollouts", "CPU s", "CPU s before", "imbalance - 1", "imbalance - 1 before"]
    header += ["micro-batches per rank (now / before)"]
    goals = "; ".join(f"{name}: {'met' if ok else 'missed'}" for name, ok in data["goals"].items())
    return (
        f"{tb.markdown(header, rows)}\n\nAt commit {data.get('commit', '?')[:10]}; before: git revision {data['ref']}; "
        f"best of {data['repeat']} paired runs. "
        f"Goals: {goals}.{tb.record_line(data)}"
    )


def table_balance_batch_speeds() -> str:
    data = tb.load("balance_batch_speeds")
    rows = []
    for row in data["rows"]:
        after, even, before = row["after"] or {}, row["even"] or {}, row["before"] or {}
        rows.append(
            [
                row["option"],
                f"{row['rollouts']:,}",
                tb.fmt(after.get("cpu_seconds"), ".3f"),
                tb.fmt(even.get("cpu_seconds"), ".3f"),
                tb.fmt(row.get("after_over_even"), ".2f"),
                tb.fmt(before.get("cpu_seconds"), ".3f") if before else "not run",
                tb.fmt(after.get("imbalance") and after["imbalance"] - 1, ".1e"),
                f"{after.get('micro_batches', '-')} / {even.get('micro_batches', '-')}",
            ]
        )
    header = ["option", "rollouts", "CPU s (speeds)", "CPU s (even)", "speeds / even", "CPU s before (speeds)"]
    header += ["imbalance - 1 (speeds)", "micro-batches per rank (speeds / even)"]
    goals = "; ".join(
        f"{name}: " + ", ".join(f"{option} {'met' if ok else 'missed'}" for option, ok in by_option.items())
        for name, by_option in data["goals"].items()
    )
    speeds = data["rows"][0]["speeds"]
    return (
        f"{tb.markdown(header, rows)}\n\nAt commit {data.get('commit', '?')[:10]}; rank speeds {speeds}; before: git "
        f"revision {data['ref']}; best of {data['repeat']} paired runs. Goals: {goals}.{tb.record_line(data)}"
    )


TABLES = {  # docs/ marker name -> the table, from the record
    "balance_batch_speed": table_balance_batch_speed,
    "balance_batch_speeds": table_balance_batch_speeds,
}


def main_speeds(args) -> None:
    """--speeds: every option with SPEEDS ("after"), with even speeds ("even") and on --ref ("before"), paired."""
    sizes = [n for n in SIZES if not args.quick or n <= 16384]
    repeat = 1 if args.quick else args.repeat
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = extract(args.ref, Path(tmp))
        for name, options in OPTIONS.items():
            for n in sizes:
                after, even, before = [], [], []
                for _ in range(repeat):  # paired: the variants alternate
                    if n <= args.before_max:
                        before.append(run_child(before_tree, n, {**options, "speeds": SPEEDS}, args.timeout))
                    even.append(run_child(REPO, n, dict(options), 600.0))
                    after.append(run_child(REPO, n, {**options, "speeds": SPEEDS}, 600.0))
                row = {"option": name, "rollouts": n, "speeds": SPEEDS, "after": best(after), "even": best(even)}
                row["before"] = best(before) if before else None
                if n <= args.before_max and row["before"] is None:
                    row["before_timed_out_s"] = args.timeout
                if row["after"] and row["even"]:
                    row["after_over_even"] = row["after"]["cpu_seconds"] / row["even"]["cpu_seconds"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    goals = {}
    for n, (text, limit) in SPEED_GOALS.items():
        mine = [r for r in rows if r["rollouts"] == n and r["after"]]
        if mine:
            ok = [r["after_over_even"] <= 2.0 if limit is None else r["after"]["cpu_seconds"] <= limit for r in mine]
            goals[f"{n} rollouts with speeds {text}"] = {r["option"]: o for r, o in zip(mine, ok)}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "balancer"], cwd=REPO, capture_output=True).stdout)
    payload = {"commit": commit, "tree_modified": dirty, "ref": args.ref, "repeat": repeat, "rows": rows}
    payload["goals"] = goals
    print(write_result("balance_batch_speeds", payload, clock="process_cpu"))


if __name__ == "__main__":
    main()
