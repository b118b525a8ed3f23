"""Uneven ranks (`Topology(rank_speeds=...)`): does the planner stay as fast and as good with speeds None, and how
much does planning for the speeds gain on uneven ranks?

1. *Speed, speeds None vs before.* The planner_speed.py shapes (WLB-LLM lengths, 100K and 1M documents, on dp64 x
   cp4 x M8 x 32,768; 1M SFT-like documents on dp4 x cp2 x M4 x 2,048; the built-in sft trace with the llama3-8b
   cost model on dp4 x cp2 x M4 and dp4 x cp2 x pp4 x M8, 2,048 tokens per rank), each planned by this tree and by
   git revision `--ref` (checked out with `git archive` into a temporary folder), each plan in its own process,
   process CPU time of the plan call, best of `--repeat`, the two versions alternating in pairs (which goes first
   alternates too). Every pair also compares the placements (a hash of the plan's arrays): bit for bit or not.
2. *Quality, speeds None vs before.* The planner_quality.py rows (four traces x dp8 / dp4 x cp8 / dp4 x cp2 x pp4,
   max_tokens the next power of two over the longest document / cp, 85% fill), metrics of both versions.
3. *Speed-aware vs speed-blind.* On uneven ranks (one replica twice as fast, or speeds 0.5/1/1.5/2 ...), the
   epoch_efficiency of the plan made for the speeds against the even plan scored on the same speeds, at the
   standard 85% fill and at 50% (a fast replica needs token room for its larger share), plus dynamic CP and
   balance_batch rows and the planning time with speeds.
Writes benchmarks/results/rank_speeds.json and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import DEFAULT_COST, RESULTS, TOPOLOGIES, standard_topology, table, write_result

import balancer
from balancer.data.traces import load_trace

REPO = Path(__file__).resolve().parents[1]
LLAMA3_8B = dict(
    hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256
)
FEW_STEPS = dict(dp=64, cp=4, micro_batches=8, max_tokens=32768)
SPEED_SHAPES = {  # name: (lengths, topology, cost)
    "wlbllm 100K, dp64 x cp4 x M8 x 32768": ("wlbllm:100000", FEW_STEPS, "default"),
    "wlbllm 1M, dp64 x cp4 x M8 x 32768": ("wlbllm:1000000", FEW_STEPS, "default"),
    "SFT-like 1M, dp4 x cp2 x M4 x 2048": (
        "sftlike:1000000",
        dict(dp=4, cp=2, micro_batches=4, max_tokens=2048),
        "default",
    ),
    "sft trace, dp4 x cp2 x M4 x 2048": ("sft", dict(dp=4, cp=2, micro_batches=4, max_tokens=2048), "llama3-8b"),
    "sft trace, dp4 x cp2 x pp4 x M8 x 2048": (
        "sft",
        dict(dp=4, cp=2, pp=4, micro_batches=8, max_tokens=2048),
        "llama3-8b",
    ),
}
INNER = 2  # plans timed per process (the best is kept)
QUALITY_KEYS = ("imbalance", "epoch_efficiency", "worst_step", "mean_delay_steps", "steps")


def lengths_of(spec: str) -> np.ndarray:
    if spec.startswith("sftlike:"):  # planner_speed.sft_like
        n = int(spec.split(":")[1])
        return np.clip(np.random.default_rng(1).lognormal(np.log(700), 0.8, n), 32, 4096).astype(np.int64)
    name, _, n = spec.partition(":")
    return load_trace(name, n=int(n), seed=1) if n else load_trace(name, seed=0)


def cost_of(name: str) -> balancer.CostModel:
    return DEFAULT_COST if name == "default" else balancer.CostModel.from_model(**LLAMA3_8B)


def fingerprint(plan) -> str:
    digest = hashlib.sha256()
    for a in (plan.doc, plan.start, plan.end, plan.mb_ptr):
        digest.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def worker(kind: str, name: str) -> dict:
    """Runs in a child process on whichever balancer PYTHONPATH gives: one timed plan, or one quality row."""
    if kind == "speed":
        spec, topo, cost = SPEED_SHAPES[name]
        lengths, topology, cost = lengths_of(spec), balancer.Topology(**topo), cost_of(cost)
        balancer.plan(lengths[: 20 * topology.bins_per_step], topology, cost, seed=0)  # imports, caches
        best = np.inf
        for _ in range(INNER):  # best of a few in the same process, then the pairs alternate the processes
            started = time.process_time()
            plan = balancer.plan(lengths, topology, cost, seed=0)
            best = min(best, time.process_time() - started)
        return {"cpu_s": best, "hash": fingerprint(plan), "steps": plan.num_steps}
    trace, tname = name.split("/")
    lengths = load_trace(trace, seed=0)
    topology = standard_topology(lengths, *TOPOLOGIES[tname])
    plan = balancer.plan(lengths, topology, DEFAULT_COST, seed=0)
    return {"hash": fingerprint(plan)} | {k: plan.metrics()[k] for k in QUALITY_KEYS}


def run_worker(tree: Path, kind: str, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", kind, name],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkout(ref: str, into: Path) -> Path:
    """The tree of git revision `ref` under `into` (its balancer and attention packages)."""
    archive = subprocess.run(
        ["git", "archive", ref, "balancer", "attention"], cwd=REPO, capture_output=True, check=True
    )
    tar_path = into / "tree.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def speed_rows(before: Path, repeat: int) -> list[dict]:
    rows = []
    print(f"| shape | before (best of {repeat}) | now, speeds None | ratio | placements |")
    print("|---|---|---|---|---|")
    for name in SPEED_SHAPES:
        load_start = round(os.getloadavg()[0], 1)
        runs: dict[str, list] = {"before": [], "now": []}
        for r in range(repeat):  # paired, alternating which version goes first
            order = (("before", before), ("now", REPO)) if r % 2 == 0 else (("now", REPO), ("before", before))
            for label, tree in order:
                runs[label].append(run_worker(tree, "speed", name))
        best = {k: min(x["cpu_s"] for x in v) for k, v in runs.items()}
        identical = all(a["hash"] == b["hash"] for a, b in zip(runs["before"], runs["now"]))
        rows.append(
            {"shape": name, "before_cpu_s": best["before"], "now_cpu_s": best["now"]}
            | {"ratio": best["now"] / best["before"], "identical_placements": identical}
            | {"pairs": [{"before": a["cpu_s"], "now": b["cpu_s"]} for a, b in zip(runs["before"], runs["now"])]}
            | {"load_1min": [load_start, round(os.getloadavg()[0], 1)]}
        )
        print(
            f"| {name} | {best['before']:.3f} s | {best['now']:.3f} s | {best['now'] / best['before']:.3f} | "
            f"{'identical' if identical else 'DIFFERENT'} |"
        )
    return rows


def quality_rows(before: Path, traces: list[str]) -> list[dict]:
    rows = []
    for trace in traces:
        for tname in TOPOLOGIES:
            old, new = (run_worker(tree, "quality", f"{trace}/{tname}") for tree in (before, REPO))
            same = old["hash"] == new["hash"] and all(old[k] == new[k] for k in QUALITY_KEYS)
            rows.append({"distribution": trace, "topology": tname, "before": old, "now": new, "identical": same})
            print(
                f"quality {trace} {tname}: imbalance {new['imbalance']:.4f} (before {old['imbalance']:.4f}), "
                f"efficiency {new['epoch_efficiency']:.4f} (before {old['epoch_efficiency']:.4f}), "
                f"{'identical' if same else 'DIFFERENT'}"
            )
    return rows


def scored(plan, speeds) -> dict:
    """`plan`'s placements on ranks of `speeds` (a speed-blind plan run on uneven ranks)."""
    groups = None if not plan.dynamic else (plan.group_start, plan.group_size, plan.slot_ptr)
    topo = dataclasses.replace(plan.topology, rank_speeds=tuple(speeds))
    blind = balancer.Plan(
        plan.lengths, topo, plan.cost_model, plan.doc, plan.start, plan.end, plan.mb_ptr, groups=groups
    )
    return blind.metrics()


def work_shares(plan) -> list[float]:
    if plan.dynamic:
        cost = plan.micro_batch_costs() / plan.group_size
        per = np.zeros(plan.topology.pool_size + 1)
        np.add.at(per, plan.group_start, cost)
        np.add.at(per, plan.group_start + plan.group_size, -cost)
        work = np.cumsum(per)[:-1]
    else:
        work = plan.micro_batch_costs().sum(axis=(0, 2))
    return [round(float(x), 4) for x in work / work.sum()]


def aware_row(label: str, lengths, topo, cost, speeds, make) -> dict:
    even = make(lengths, topo, cost)
    started = time.process_time()
    aware = make(lengths, dataclasses.replace(topo, rank_speeds=tuple(speeds)), cost)
    seconds = time.process_time() - started
    aware.validate()
    ma, mb = aware.metrics(), scored(even, speeds)
    row = {"case": label, "topology": str(topo), "speeds": list(speeds), "aware": {}, "blind": {}}
    for key in ("epoch_efficiency", "imbalance", "step_time_total", "steps"):
        row["aware"][key], row["blind"][key] = ma[key], mb[key]
    row |= {"speedup": mb["step_time_total"] / ma["step_time_total"], "plan_cpu_s": seconds}
    row |= {"work_shares": work_shares(aware), "speed_shares": [round(s / sum(speeds), 4) for s in speeds]}
    print(
        f"| {label} | {', '.join(f'{s:g}' for s in speeds)} | {ma['epoch_efficiency']:.4f} | "
        f"{mb['epoch_efficiency']:.4f} | "
        f"{row['speedup']:.3f}x | {ma['steps']} / {mb['steps']} | {seconds:.2f} s |"
    )
    return row


def uneven_rows() -> list[dict]:
    def plan(lengths, topo, cost):
        return balancer.plan(lengths, topo, cost, seed=0, overflow="split")

    def batch(lengths, topo, cost):
        return balancer.balance_batch(lengths, topo, cost, seed=0, micro_batches="auto")

    print("| case | speeds | aware efficiency | blind efficiency | speedup | steps aware / blind | plan CPU |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for trace in ("wlbllm", "sft"):
        lengths = load_trace(trace, seed=0)
        for tname, (dp, cp, pp, m) in TOPOLOGIES.items():
            for fill in (0.85, 0.5):
                topo = standard_topology(lengths, dp, cp, pp, m, fill=fill)
                for speeds in ((1.0,) * (dp - 1) + (2.0,), tuple(np.linspace(0.5, 2.0, dp).round(3).tolist())):
                    rows.append(aware_row(f"{trace} {tname} fill {fill}", lengths, topo, DEFAULT_COST, speeds, plan))
    sft = load_trace("sft", seed=0)
    dyn = dict(dp=4, cp=2, micro_batches=4, max_tokens=8192, cp_sizes=(1, 2, 4))
    for speeds in ((1.0,) * 4 + (2.0,) * 4, (1.0, 1.0, 2.0, 2.0) * 2):
        topo = balancer.Topology(**dyn, tokens_per_step=120_000)
        rows.append(aware_row("sft dynamic CP (1, 2, 4)", sft, topo, DEFAULT_COST, speeds, plan))
    rl = load_trace("wlbllm", n=512, seed=5)
    for pp in (1, 2):
        topo = balancer.Topology(dp=4, pp=pp, micro_batches=4, max_tokens=131072)
        for speeds in ((1.0, 1.0, 1.0, 2.0), (0.5, 1.0, 1.5, 2.0)):
            rows.append(aware_row(f"balance_batch wlbllm 512, pp{pp}", rl, topo, DEFAULT_COST, speeds, batch))
    return rows


def _how(record: dict) -> dict:
    """How a whole results record was measured (date, load at start and end, commit)."""
    machine = record.get("machine", {})
    return {"date": record.get("date"), "load_start": machine.get("load_average_start")} | {
        "load_end": machine.get("load_average_end"),
        "commit": (record.get("git") or {}).get("commit"),
    }


def _measured(payload: dict, section: str, run):
    """Run one section, recording its own date, 1/5/15-minute load at its start and end, and the commit."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    start, date = [round(x, 2) for x in os.getloadavg()], time.strftime("%Y-%m-%d %H:%M:%S")
    out = run()
    end = [round(x, 2) for x in os.getloadavg()]
    payload["measured"][section] = {"date": date, "load_start": start, "load_end": end, "commit": commit}
    return out


def tables(payload: dict) -> dict:
    """The tables docs/planner.md shows (rendered by benchmarks/tables.py as rank_speeds.KEY)."""
    out = {}
    ref = payload["ref"][:7]
    if "speed" in payload:
        rows = [
            [r["shape"], f"{r['before_cpu_s']:.3f} s", f"{r['now_cpu_s']:.3f} s", f"{r['ratio']:.3f}"]
            + ["identical" if r["identical_placements"] else "different"]
            + ["{} / {}".format(*r["load_1min"]) if "load_1min" in r else "-"]
            for r in payload["speed"]
        ]
        columns = ["shape", f"before ({ref})", "now, speeds None", "ratio", "placements", "1-min load start / end"]
        out["even"] = table(columns, rows)
    if "quality" in payload:
        rows = [
            [r["distribution"], r["topology"], f"{r['now']['imbalance']:.4f}", f"{r['before']['imbalance']:.4f}"]
            + [f"{r['now']['epoch_efficiency']:.4f}", "identical" if r["identical"] else "different"]
            for r in payload["quality"]
        ]
        columns = ["trace", "topology", "imbalance", f"before ({ref})", "epoch_efficiency", "placements, metrics"]
        out["quality"] = table(columns, rows)
    if "uneven" in payload:
        rows = [
            [r["case"], ", ".join(f"{s:g}" for s in r["speeds"])]
            + [f"{r['aware']['epoch_efficiency']:.4f}", f"{r['blind']['epoch_efficiency']:.4f}"]
            + [f"{r['speedup']:.3f}x", f"{r['aware']['steps']} / {r['blind']['steps']}", f"{r['plan_cpu_s']:.2f} s"]
            for r in payload["uneven"]
        ]
        columns = ["case", "speeds", "aware efficiency", "blind efficiency", "speedup", "steps", "plan CPU"]
        out["uneven"] = table(columns, rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="main", help="git revision planned beside this tree (speeds None)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--traces", nargs="+", default=["wlbllm", "prolong", "sft", "heavy"])
    ap.add_argument("--skip", nargs="*", default=[], choices=["speed", "quality", "uneven"])
    ap.add_argument(
        "--keep",
        action="store_true",
        help="sections in --skip are kept from the existing results file (with their own record)",
    )
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    ref = subprocess.run(["git", "rev-parse", args.ref], cwd=REPO, capture_output=True, text=True).stdout.strip()
    payload: dict = {"ref": ref, "measured": {}}
    kept = json.loads((RESULTS / "rank_speeds.json").read_text()) if args.keep else {}
    for section in args.skip:
        if section in kept:  # an earlier run's section, with how that run was measured
            payload[section] = kept[section]
            payload["measured"][section] = kept.get("measured", {}).get(section) or _how(kept)
    with tempfile.TemporaryDirectory() as tmp:
        before = checkout(args.ref, Path(tmp))
        for section, run in (
            ("speed", lambda: speed_rows(before, args.repeat)),
            ("quality", lambda: quality_rows(before, args.traces)),
        ):
            if section not in args.skip:
                payload[section] = _measured(payload, section, run)
    if "uneven" not in args.skip:
        payload["uneven"] = _measured(payload, "uneven", uneven_rows)
    payload["tables"] = tables(payload)
    path = write_result("rank_speeds", payload, clock="process_cpu")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
