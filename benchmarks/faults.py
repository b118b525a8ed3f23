"""Faults with torchft on CPU: 4 replica groups, one killed (SIGKILL) every `--every` committed steps and started
again `--rejoin` seconds later, against the same run without failures; one command:

    .venv/bin/python benchmarks/faults.py            # writes benchmarks/results/faults.json
    .venv/bin/python benchmarks/faults.py --table    # the table of docs/fault-tolerance.md (benchmarks/tables.py)

Runs, in this order in one invocation: failure-free, faulty, faulty without the loop's `pg.abort()` after a step
that did not commit (the ablation; `--no-ablation` skips it), failure-free again (the two bracket the faulty runs:
their spread is the load's drift and the run-to-run noise). Figures: documents lost / duplicated over the
committed steps (this project's FaultTolerantBatches, and torchft's own DistributedSampler dealt over the same
run's membership: each group takes its shard's next batch in every committed step it contributed to, a killed
group restarts its shard from the start, as torchft's example loop does without a data checkpoint); goodput, as
the goal states it: tokens of committed steps per second of the faulty run (first quorum to last commit) over
the failure-free runs' (their mean, and each), against the replica-seconds available per second of each run
(group-seconds alive over groups x wall, faulty over failure-free; a killed group is down from its last step to
its next life's first); the plans' predicted imbalance in steps with a group missing against the failure-free
steps'; where each kill's seconds went (benchmarks/faults_where.py).
Wall clock (time.time); the machine's load is recorded at start and end.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults_run  # noqa: E402
import faults_where  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "faults.json"
# The recommended settings (docs/fault-tolerance.md; measured with benchmarks/faults_where.py on this machine)
COMM_TIMEOUT = 3.0  # seconds a reduction (and the Manager) waits for a peer that hangs without closing its sockets
HEARTBEAT_TIMEOUT_MS = 1500  # the lighthouse counts a replica dead after this long without a heartbeat
JOIN_TIMEOUT_MS = 1000  # a new quorum waits this long for heartbeating replicas that have not joined it
HEARTBEAT_INTERVAL_MS = 100  # each Manager heartbeats this often (torchft's default)


def downtime(lines: list, groups: int) -> float:
    """Group-seconds between a killed group's last line and its next life's first (or the run's end)."""
    end = max(r["t1"] for r in lines)
    total = 0.0
    for g in range(groups):
        lives = sorted({r["life"] for r in lines if r["group"] == g})
        last = [max(r["t1"] for r in lines if r["group"] == g and r["life"] == life) for life in lives]
        first = [min(r["t0"] for r in lines if r["group"] == g and r["life"] == life) for life in lives]
        total += sum(b - a for a, b in zip(last[:-1], first[1:]))
        total += max(0.0, end - last[-1] - 1.0)  # a group that did not come back before the end
    return total


def torchft_sampler(cfg: faults_run.Config, steps: dict, lines: list) -> dict:
    """Lost / duplicated documents of torchft.data.DistributedSampler over the faulty run's membership."""
    from torchft.data import DistributedSampler

    lengths = cfg.lengths()
    per = max(1, round(np.mean([sum(len(mb) for mine in s["items"] for mb in mine) for s in steps.values()])
                       / cfg.groups))  # fmt: skip
    life_at = {}  # (group, committed step) -> the life that contributed
    for r in lines:
        if r["committed"] and r["plan"] and r["rank"] == 0:
            life_at[(r["group"], r["committed_before"])] = r["life"]
    counts = np.zeros(len(lengths), dtype=np.int64)
    for g in range(cfg.groups):
        shard = list(DistributedSampler(range(len(lengths)), replica_rank=g, num_replica_groups=cfg.groups,
                                        group_rank=0, num_replicas=1, shuffle=True, seed=cfg.seed))  # fmt: skip
        pos, life = 0, 0
        for k in sorted(steps):
            if (g, k) not in life_at:
                continue
            if life_at[(g, k)] != life:
                pos, life = 0, life_at[(g, k)]
            for d in shard[pos : pos + per]:
                counts[d] += 1
            pos += per
    return {"lost": int((counts == 0).sum()), "duplicated": int((counts > 1).sum()), "docs_per_group_step": per}


def measured_imbalance(lines: list) -> list:
    """Per committed step whose every contributor logged it: the slowest contributor's measured compute over the
    contributors' mean (the device time of its micro-batches)."""
    by: dict = {}
    for r in lines:
        if r["committed"] and r["plan"] and r["rank"] == 0:
            by.setdefault(r["committed_before"], {})[r["group"]] = (r["compute"], len(r["plan"][0]))
    out = []
    for k in sorted(by):
        times = [t for t, _ in by[k].values()]
        if len(times) == next(iter(by[k].values()))[1] and min(times) > 0:
            out.append(max(times) / float(np.mean(times)))
    return out


def summarise(cfg: faults_run.Config, result: dict) -> dict:
    steps = faults_run.committed_steps(result["lines"])
    cov = faults_run.coverage(steps, cfg.lengths())
    tokens = sum(int(cfg.lengths()[p[0]]) if len(p) == 1 else p[2] - p[1]
                 for s in steps.values() for mine in s["items"] for mb in mine for p in mb)  # fmt: skip
    lines = [r for r in result["lines"] if r["rank"] == 0]
    members, changes, full, per_step = None, [], [], {}
    for k in sorted(steps):
        r = next(x for x in lines if x["committed"] and x["plan"] and x["committed_before"] == k)
        if r["imbalance"] is None:
            continue
        if members is not None and r["plan"][0] != members:
            changes.append({"step": k, "groups": len(r["plan"][0]), "predicted_imbalance": r["imbalance"]})
        per_step[str(k)] = r["imbalance"]
        if len(r["plan"][0]) == cfg.groups:
            full.append(r["imbalance"])
        members = r["plan"][0]
    wall = max(r["t1"] for r in lines) - min(r["t0"] for r in lines)  # first quorum to last commit
    measured = measured_imbalance(result["lines"])
    return {
        "wall_seconds": wall, "committed_steps": len(steps), "tokens": tokens, "tokens_per_second": tokens / wall,
        "lost": cov["lost"], "duplicated": cov["duplicated"],
        "alive_fraction": 1 - downtime(lines, cfg.groups) / (cfg.groups * wall),
        "predicted_imbalance_all_groups": float(np.mean(full)) if full else None,
        "predicted_imbalance_after_changes": changes, "predicted_imbalance_per_step": per_step,
        "measured_imbalance": float(np.mean(measured)) if measured else None,
        "measured_steps": len(measured), "lives": result["lives"],
    }  # fmt: skip


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1400)
    ap.add_argument("--every", type=int, default=20, help="committed steps between kills")
    ap.add_argument("--rejoin", type=float, default=2.0, help="seconds before a killed group starts again")
    ap.add_argument("--work", type=float, default=40.0, help="device seconds (slept) per 1e6 cost units")
    ap.add_argument("--comm-timeout", type=float, default=COMM_TIMEOUT, help="Manager + gloo timeout (seconds)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS, help="lighthouse: dead after")
    ap.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS, help="lighthouse: wait for stragglers")
    ap.add_argument("--heartbeat-interval-ms", type=int, default=HEARTBEAT_INTERVAL_MS, help="Manager heartbeats")
    ap.add_argument("--no-ablation", action="store_true", help="skip the faulty run without the abort line")
    ap.add_argument("--table", action="store_true", help="print the markdown table from the record and exit")
    return ap.parse_args()


def run_all(args: argparse.Namespace, base: dict) -> dict:
    """The runs in this order: failure-free, faulty, (faulty without the abort line), failure-free again: the
    faulty runs sit between the two failure-free ones, so a drift of the machine's load shows as their spread."""
    phases = ("forward", "reduce", "between")
    kills = [[i % 4, args.every * (i + 1), phases[i % 3]] for i in range(12)]
    order = [("failure_free", [], True), ("faulty", kills, True)]
    order += [] if args.no_ablation else [("faulty_no_abort", kills, False)]
    order += [("failure_free_repeat", [], True)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, k, abort in order:
            cfg = faults_run.Config(out=f"{tmp}/{name}", kills=k, abort_failed=abort, **base)
            result = faults_run.run(cfg)
            runs[name] = summarise(cfg, result)
            if k:
                done = runs[name]["kills_done"] = sum(result["lives"].values())
                runs[name]["where"] = faults_where.where_seconds_go(result["lines"], cfg.groups, done)
            if name == "faulty":
                committed = faults_run.committed_steps(result["lines"])
                runs["torchft_sampler"] = torchft_sampler(cfg, committed, result["lines"])
    return runs


def goodput(runs: dict, name: str) -> dict:
    """A faulty run's tokens per second over the failure-free runs' (their mean; each one's beside it) and its
    groups' alive fraction over theirs (1: no group was down), per second of each run."""
    ff = [runs[n]["tokens_per_second"] for n in ("failure_free", "failure_free_repeat")]
    fy = runs[name]
    return {
        "goodput": fy["tokens_per_second"] / float(np.mean(ff)),
        "goodput_each_baseline": [fy["tokens_per_second"] / x for x in ff],
        "available": fy["alive_fraction"] / runs["failure_free"]["alive_fraction"],
    }


def main() -> None:
    args = arguments()
    if args.table:
        print(table(json.loads(OUT.read_text())))
        return
    load0 = os.getloadavg()
    base = dict(groups=4, docs=args.docs, work=args.work, rejoin_seconds=args.rejoin, timeout_s=900.0,
                comm_timeout_s=args.comm_timeout, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                join_timeout_ms=args.join_timeout_ms, heartbeat_interval_ms=args.heartbeat_interval_ms)  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    runs = run_all(args, base)
    ff, fy, rep = runs["failure_free"], runs["faulty"], runs["failure_free_repeat"]
    for c in fy["predicted_imbalance_after_changes"]:  # the same step (the same documents) without failures
        c["failure_free"] = ff["predicted_imbalance_per_step"].get(str(c["step"]))
    diffs = [c["predicted_imbalance"] - c["failure_free"] for c in fy["predicted_imbalance_after_changes"]]
    record = {
        "question": "faults with torchft: exactly once, goodput and balance with a group killed every ~20 steps",
        "clock": "wall (time.time)", "machine": {"cores": os.cpu_count(), "load_start": load0,
                                                 "load_end": os.getloadavg()},
        "commit": commit, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {**base, "every": args.every, "abort_failed": True}, "runs": runs,
        **goodput(runs, "faulty"),
        "ablation_no_abort": None if args.no_ablation else goodput(runs, "faulty_no_abort"),
        "predicted_after_changes_minus_same_step_failure_free": max(diffs) if diffs else None,
        "measured_minus_failure_free": fy["measured_imbalance"] - ff["measured_imbalance"],
        "measured_noise_paired_repeat": abs(rep["measured_imbalance"] - ff["measured_imbalance"]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }  # fmt: skip
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))


def _noise_verdict(difference: float, noise: float) -> str:
    """Measured imbalance with failures minus without, against the paired repeat's noise: met within it; outside
    it, which side (a faulty run better balanced than the failure-free one is outside the noise, not worse)."""
    if abs(difference) <= noise:
        return verdict(True)
    return verdict(False) + (", on the better side: the faulty run was better balanced" if difference < 0 else "")


def verdict(met: bool) -> str:
    return "met" if met else "missed"


def where_text(where: dict | None) -> str:
    """Where a faulty run's kill time went, in words (benchmarks/faults_where.py)."""
    if where is None:
        return ""
    parts = ", ".join(f"{k.replace('_', ' ')} +{v:.2f} s" for k, v in where["excess_seconds_per_kill"].items())
    steps, lost = where["uncommitted_steps_per_kill"], where["uncommitted_seconds_per_kill"]
    return f"{steps:.1f} uncommitted group-steps ({lost:.2f} s), and in the committed steps it slowed {parts}"


def table(r: dict) -> str:
    """The markdown table of docs/fault-tolerance.md from a record."""
    ff, fy, tf = r["runs"]["failure_free"], r["runs"]["faulty"], r["runs"]["torchft_sampler"]
    rep, ab = r["runs"]["failure_free_repeat"], r["runs"].get("faulty_no_abort")
    after = [c["predicted_imbalance"] for c in fy["predicted_imbalance_after_changes"]]
    mean, worst = (float(np.mean(after)), max(after)) if after else (float("nan"), float("nan"))
    same = r["predicted_after_changes_minus_same_step_failure_free"]

    def row(name: str, x: dict) -> str:
        return (
            f"| {name} | {x['committed_steps']} | {x['lost']} | {x['duplicated']} | {x['tokens_per_second']:.0f} | "
            f"{x['alive_fraction']:.3f} | {x['predicted_imbalance_all_groups']:.4f} | {x['measured_imbalance']:.4f} |"
        )

    c = r["config"]
    each = ", ".join(f"{g:.3f}" for g in r["goodput_each_baseline"])
    each_verdict = ", ".join(verdict(g >= 0.9 * r["available"]) for g in r["goodput_each_baseline"])
    rows = [
        "| run | committed steps | lost | duplicated | tokens/s | groups alive | predicted imbalance (all groups) "
        "| measured imbalance |",
        "|---|---|---|---|---|---|---|---|",
        row("failure-free", ff),
        row("faulty, FaultTolerantBatches", fy),
        *([row("faulty, without aborting the process group (ablation)", ab)] if ab else []),
        row("failure-free, repeat", rep),
        f"| faulty, torchft DistributedSampler (same membership) | - | {tf['lost']} | {tf['duplicated']} "
        "| - | - | - | - |",
        "",
        f"Goodput {r['goodput']:.3f} of the failure-free runs' tokens per second (against each: {each}) with "
        f"{r['available']:.3f} of their groups alive on average (goal: goodput >= 0.9 x that = "
        f"{0.9 * r['available']:.3f}: {verdict(r['goodput'] >= 0.9 * r['available'])} against their mean; against "
        f"each: {each_verdict}). Per kill ({fy.get('kills_done', 0)} kills; steps of "
        f"{fy['where']['median_step_seconds']:.2f} s, group-seconds summed over the groups): "
        f"{where_text(fy.get('where'))}."
        + (
            ""
            if ab is None
            else f" Without aborting the process group after a step that did not commit: goodput "
            f"{r['ablation_no_abort']['goodput']:.3f} with {r['ablation_no_abort']['available']:.3f} alive; per kill "
            f"{where_text(ab.get('where'))}."
        )
        + f" Settings: gloo/Manager timeout {c['comm_timeout_s']:g} s, lighthouse heartbeat timeout "
        f"{c['heartbeat_timeout_ms']} ms, join timeout {c['join_timeout_ms']} ms, Manager heartbeat every "
        f"{c['heartbeat_interval_ms']} ms.",
        "",
        f"Predicted imbalance in the {len(after)} steps right after a membership change: mean {mean:.4f}, worst "
        f"{worst:.4f} (failure-free steps: {ff['predicted_imbalance_all_groups']:.4f}); the most any of them exceeds "
        f"the same step's in the failure-free run: {same:+.4f} (goal within 0.02: {verdict(same <= 0.02)}). "
        f"Measured imbalance {fy['measured_imbalance']:.4f} against {ff['measured_imbalance']:.4f} failure-free; "
        f"paired-repeat noise {r['measured_noise_paired_repeat']:.4f}, from one pair (goal within it: "
        f"{_noise_verdict(r['measured_minus_failure_free'], r['measured_noise_paired_repeat'])}). "
        f"{r['machine']['cores']} cores, load "
        f"{r['machine']['load_start'][0]:.2f} at the start and {r['machine']['load_end'][0]:.2f} at the end; "
        f"commit {r['commit'][:7]}; {r['date']}; `{r['command']}`.",
    ]
    return "\n".join(rows)


TABLES = {"faults": lambda: table(json.loads(OUT.read_text()))}  # docs/fault-tolerance.md (benchmarks/tables.py)

if __name__ == "__main__":
    main()
