"""Do predicted speedups hold when the micro-batches really run? A measured replay of sampled plan steps.

The wlbllm trace scaled to this machine (lengths // 16, at least 1; the dp4 x cp2 topology's token budgets scaled
alike: max_tokens = 65536 / 16 = 4096 per CP rank, tokens_per_step = 0.85 x capacity) is planned four ways:
this planner with the hybrid CP layout and with zigzag, TRL's BFD packing (benchmarks/peers.py, zigzag) and
token-count packing (balancer.planning.baseline, zigzag). For each, `--steps` steps spread evenly over the epoch are
replayed: every micro-batch of every replica runs forward + backward through a tiny Llama on a CP group of two gloo
processes (one replica at a time; process CPU time, the slowest rank's, min over `--repeats`). Step times come from
the 1F1B formula (balancer.planning.metrics.step_times), an epoch's time is the mean sampled step times the plan's
step count. Predictions use the calibrated model (benchmarks/calibration.py writes it) through `Plan.predict` with
the same layout. Writes benchmarks/results/measured_speedup.json.

    python benchmarks/measured_speedup.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

from _common import RESULTS, standard_topology, write_result
from peers import trl_plan

import balancer
from attention.layout import KINDS as LAYOUT_KINDS
from balancer.calibration import TINY_LLAMA, error_summary
from balancer.calibration.timing import time_micro_batches
from balancer.data.traces import load_trace
from balancer.planning import metrics
from balancer.planning.baseline import token_count_plan

COST_FILE = RESULTS / "cost_tiny_llama_cpu.json"
SCALE = 16


def scaled_setup(micro_batches: int):
    lengths = np.maximum(1, load_trace("wlbllm") // SCALE)
    full = load_trace("wlbllm")
    topo_full = standard_topology(full, dp=4, cp=2, pp=1, m=micro_batches)
    topo = balancer.Topology(
        dp=4,
        cp=2,
        micro_batches=micro_batches,
        max_tokens=topo_full.max_tokens // SCALE,
        tokens_per_step=topo_full.tokens_per_step // SCALE,
    )
    return lengths, topo


def sampled_steps(plan: balancer.Plan, count: int) -> np.ndarray:
    """`count` steps spread evenly over the epoch (the last, possibly partial, step left out)."""
    last = max(0, plan.num_steps - 2)
    return np.unique(np.linspace(0, last, count).round().astype(int))


def micro_batch_lengths(plan: balancer.Plan, step: int) -> list[list[int]]:
    """Document lengths of every micro-batch of one step, in plan order (replica-major)."""
    t = plan.topology
    sizes = plan.end - plan.start
    base = step * t.bins_per_step
    return [sizes[plan.mb_ptr[k] : plan.mb_ptr[k + 1]].tolist() for k in range(base, base + t.bins_per_step)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps replayed per plan")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--predict-only",
        action="store_true",
        help="reuse the measured times of the last results JSON, recompute the predictions with the current model",
    )
    args = ap.parse_args()
    if not COST_FILE.exists():
        sys.exit(f"{COST_FILE} is missing: run benchmarks/calibration.py first")
    cost = balancer.CostModel.load(COST_FILE)
    previous = json.loads((RESULTS / "measured_speedup.json").read_text()) if args.predict_only else None
    # the plans are made with the model of the timed run, so that re-predicting keeps the micro-batches that ran
    plan_cost = balancer.CostModel.from_dict(previous["plan_cost_model"]) if previous else cost
    lengths, topo = scaled_setup(args.micro_batches)
    plans = {
        "balancer": balancer.plan(lengths, topo, plan_cost, seed=args.seed),
        "trl-bfd": trl_plan(lengths, topo, plan_cost, seed=args.seed),
        "token-count": token_count_plan(lengths, topo, plan_cost, seed=args.seed),
    }
    configs = [("balancer+hybrid", "balancer", "hybrid"), ("balancer+zigzag", "balancer", "zigzag")]
    configs += [("trl-bfd", "trl-bfd", "zigzag"), ("token-count", "token-count", "zigzag")]
    missing = [name for name, _, kind in configs if kind not in LAYOUT_KINDS]
    configs = [c for c in configs if c[0] not in missing]
    if previous:
        measured = {name: np.array(row["measured_micro_batch_seconds"]) for name, row in previous["rows"].items()}
        run_info = {k: previous[k] for k in ("replay_seconds", "micro_batches_run", "loadavg_before", "loadavg_after")}
    else:
        measured, run_info = replay(plans, configs, topo, args)
    rows = {}
    for name, plan_name, kind in configs:
        rows[name] = summarize(plans[plan_name], kind, cost, measured[name].ravel(), args.steps)
    payload = compare(rows, missing)
    payload.update(
        topology=topo.to_dict(),
        scale=SCALE,
        cost_model=cost.to_dict(),
        plan_cost_model=plan_cost.to_dict(),
        model_config=TINY_LLAMA,
        **run_info,
        note="2 shared CPUs, other jobs running; times are process CPU time (the slowest CP rank), min of repeats",
    )
    path = write_result("measured_speedup", payload, clock="wall")
    print_table(payload)
    print(f"wrote {path}")


def replay(plans: dict, configs: list, topo, args) -> tuple[dict, dict]:
    """Run every micro-batch of the sampled steps of every configuration; returns measured seconds per config."""
    jobs, index = [], []
    for name, plan_name, kind in configs:
        for s in sampled_steps(plans[plan_name], args.steps):
            for mb in micro_batch_lengths(plans[plan_name], int(s)):
                jobs.append({"lengths": mb, "cp": topo.cp, "layout": kind, "options": {}})
                index.append(name)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    times = time_micro_batches(TINY_LLAMA, jobs, repeats=args.repeats, progress=sys.stderr.isatty())
    info = {
        "replay_seconds": time.perf_counter() - t0,
        "micro_batches_run": len(jobs),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    seconds = np.array([min(r[1] for r in reps) for reps in times])
    index = np.array(index)
    return {name: seconds[index == name] for name, _, _ in configs}, info


def summarize(plan: balancer.Plan, kind: str, cost, measured: np.ndarray, steps: int) -> dict:
    t = plan.topology
    sampled = sampled_steps(plan, steps)
    measured = measured.reshape(len(sampled), t.dp, t.micro_batches)
    prediction = plan.predict(cost, layout=kind)
    predicted = prediction["micro_batch_times"][sampled]
    # step_times applies the 1F1B formula to per-micro-batch costs before the division by cp
    measured_step = metrics.step_times(measured * t.cp, t)
    predicted_step = metrics.step_times(predicted * t.cp, t)
    return {
        "layout": kind,
        "num_steps": plan.num_steps,
        "sampled_steps": sampled.tolist(),
        "measured_micro_batch_seconds": measured.tolist(),
        "measured_step_seconds": measured_step.tolist(),
        "predicted_step_seconds": predicted_step.tolist(),
        "measured_epoch_seconds": float(measured_step.mean() * plan.num_steps),
        "predicted_epoch_seconds_sampled": float(predicted_step.mean() * plan.num_steps),
        "predicted_epoch_seconds_full": prediction["step_time_total"],
        "micro_batch_error": error_summary(predicted.ravel(), measured.ravel()),
        "step_error": error_summary(predicted_step, measured_step),
        "kv_tokens_moved": prediction["kv_tokens_moved"],
    }


def compare(rows: dict, missing: list[str]) -> dict:
    base = rows["trl-bfd"]
    for row in rows.values():
        row["measured_speedup_vs_trl"] = base["measured_epoch_seconds"] / row["measured_epoch_seconds"]
        row["predicted_speedup_vs_trl"] = (
            base["predicted_epoch_seconds_sampled"] / row["predicted_epoch_seconds_sampled"]
        )
        row["predicted_speedup_vs_trl_full"] = (
            base["predicted_epoch_seconds_full"] / row["predicted_epoch_seconds_full"]
        )
        row["measured_over_predicted_speedup"] = row["measured_speedup_vs_trl"] / row["predicted_speedup_vs_trl"]
    by_measured = sorted(rows, key=lambda k: rows[k]["measured_epoch_seconds"])
    by_predicted = sorted(rows, key=lambda k: rows[k]["predicted_epoch_seconds_sampled"])
    return {
        "rows": rows,
        "ranking_measured": by_measured,
        "ranking_predicted": by_predicted,
        "ranking_correct": by_measured == by_predicted,
        "not_run": {name: "this build has no such CP layout" for name in missing},
    }


def print_table(payload: dict) -> None:
    print(f"{'plan':>16} {'steps':>5} {'measured s':>11} {'predicted s':>11} {'speedup':>8} {'pred':>6} {'ratio':>6}")
    for name, r in payload["rows"].items():
        print(
            f"{name:>16} {r['num_steps']:5d} {r['measured_epoch_seconds']:11.1f} "
            f"{r['predicted_epoch_seconds_sampled']:11.1f} {r['measured_speedup_vs_trl']:8.3f} "
            f"{r['predicted_speedup_vs_trl']:6.3f} {r['measured_over_predicted_speedup']:6.2f}"
        )
    print(f"ranking measured {payload['ranking_measured']}, predicted {payload['ranking_predicted']}")


if __name__ == "__main__":
    main()
