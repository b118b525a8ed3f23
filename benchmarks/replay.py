"""Do the planner's predicted gains hold when plans really train? A like-for-like replay of whole epochs.

The same documents (`--documents` drawn from the wlbllm trace, lengths // 16, at least 1; the same for every plan)
are planned several ways and every step of every plan trains a tiny Llama (balancer.calibration.TINY_LLAMA) on real
processes: each DP replica is a process (a CP group: `cp` processes), all running at once in one gloo world with no
more processes than the machine has cores; a step is every micro-batch of every replica (forward + backward, the
plan's CP layout), the all-reduce of the gradients over all ranks and the AdamW step (benchmarks/_replay_worker.py).
Plans are interleaved step by step so that load changes reach all of them alike.

Two runs, each with its own question:
- `dp2`: dp 2 x cp 1, M = 4, 8192 tokens per micro-batch. This planner, TRL's BFD packing (benchmarks/peers.py:
  rows of 8192 tokens, dp * M rows per step) and token-count packing (balancer.planning.baseline), all on the same
  documents. TRL's global batch is fixed in rows (its steps hold ~98% of the capacity), the planner's in tokens
  (85% by default, within +-10%): the step counts differ, so plans are compared on the epoch's time, i.e. per-token
  throughput over the same documents, with every step's all-reduce and optimizer step paid. CP 1: no layout.
- `layout`: dp 1 x cp 2, M = 4, 4096 tokens per CP rank: the planner's plan run with the zigzag and with the hybrid
  CP layout (the same micro-batches): the layout gain alone.

Repetitions (`--reps`, default 5): each run's world is started afresh `reps` times, every time training every
plan's whole epoch, the plans' order within a step rotating from step to step and from repetition to repetition.
Each repetition gives every plan an epoch time on both clocks; a plan's speedup over another is the median of the
per-repetition (paired) ratios with their spread (min-max), and `pairs` states, per clock, whether one plan was
faster in every repetition or the two are within noise (each faster in some repetition).

Predictions: `Plan.predict(cost, layout=...)` with the calibrated model (benchmarks/calibration.py writes it), on
the model's clock; they cover the micro-batches' compute, not the all-reduce or the optimizer step (the report
lists those measured). `ranking_correct` compares the measured epoch ranking (median epochs) with the predicted one.

    python benchmarks/replay.py [--documents 6000] [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import _render as tb
from _common import RESULTS, free_port, write_result
from _replay_worker import worker
from peers import trl_plan

import balancer
from balancer.calibration import TINY_LLAMA, error_summary
from balancer.data.traces import load_trace
from balancer.planning.baseline import token_count_plan

COST_FILE = RESULTS / "cost_tiny_llama_cpu.json"
SCALE = 16
PLANNERS = {"balancer": balancer.plan, "trl-bfd": trl_plan, "token-count": token_count_plan}
RUNS = {  # name: (dp, cp, max_tokens per CP rank, [(label, planner, layout)])
    "dp2": (
        2,
        1,
        8192,
        [
            ("balancer", "balancer", "zigzag"),
            ("trl-bfd", "trl-bfd", "zigzag"),
            ("token-count", "token-count", "zigzag"),
        ],
    ),
    "layout": (1, 2, 4096, [("balancer+zigzag", "balancer", "zigzag"), ("balancer+hybrid", "balancer", "hybrid")]),
}


def documents(count: int, seed: int) -> np.ndarray:
    """`count` documents of the wlbllm trace scaled down 16x, drawn without replacement (seeded)."""
    lengths = np.maximum(1, load_trace("wlbllm") // SCALE)
    return lengths[np.random.default_rng(seed).permutation(len(lengths))[:count]]


def step_payload(plan: balancer.Plan, layout: str) -> dict:
    """The plan as the worker runs it: per step, per replica, the micro-batches' document lengths."""
    t = plan.topology
    sizes = plan.end - plan.start
    steps, tokens = [], []
    for s in range(plan.num_steps):
        base = s * t.bins_per_step
        mbs = [sizes[plan.mb_ptr[k] : plan.mb_ptr[k + 1]].tolist() for k in range(base, base + t.bins_per_step)]
        steps.append([mbs[r * t.micro_batches : (r + 1) * t.micro_batches] for r in range(t.dp)])
        tokens.append(int(sum(sum(mb) - len(mb) for mb in mbs)))  # label tokens: a document's last predicts nothing
    return {"layout": layout, "steps": steps, "tokens": tokens}


def train(plans: dict, dp: int, cp: int, threads: int, offset: int = 0) -> dict:
    """Run the worker world once (`offset`: where the rotation of the plans' order in a step starts); returns
    {name: [rank][step] results}."""
    import torch.multiprocessing as mp

    world = dp * cp
    if world > (os.cpu_count() or 1):
        raise SystemExit(f"dp * cp = {world} processes > {os.cpu_count()} cores: pick a smaller topology")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    payload = {"config": TINY_LLAMA, "dp": dp, "cp": cp, "threads": threads, "plans": plans, "offset": offset}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "replay")
        mp.spawn(worker, args=(world, free_port(), payload, out), nprocs=world, join=True)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    return {name: [rank[name] for rank in ranks] for name in plans}


def measured_times(per_rank: list[list[dict]], dp: int, cp: int, clock: int) -> dict:
    """Per step (clock 0 wall, 1 CPU): the step (max over ranks), compute (slowest replica's micro-batches, each the
    slowest CP rank's), all-reduce and optimizer (max over ranks); micro-batch times [steps, dp, M]."""
    steps = len(per_rank[0])
    step = np.array([[r[k]["step"][clock] for r in per_rank] for k in range(steps)]).max(axis=1)
    mb = np.array([[[m[clock] for m in r[k]["micro_batches"]] for r in per_rank] for k in range(steps)])
    mb = mb.reshape(steps, dp, cp, -1).max(axis=2)  # [steps, dp, M]
    reduce = np.array([[r[k]["all_reduce"][clock] for r in per_rank] for k in range(steps)]).max(axis=1)
    opt = np.array([[r[k]["optimizer"][clock] for r in per_rank] for k in range(steps)]).max(axis=1)
    return {"step": step, "compute": mb.sum(axis=2).max(axis=1), "micro_batch": mb, "all_reduce": reduce, "opt": opt}


def median_times(reps: list[list[list[dict]]], dp: int, cp: int, clock: int) -> dict:
    """measured_times of every repetition (`reps`: [rep][rank][step] results) reduced step by step to their median,
    with `epochs`: each repetition's epoch time (the sum of its steps) on that clock."""
    each = [measured_times(per_rank, dp, cp, clock) for per_rank in reps]
    out = {key: np.median(np.stack([m[key] for m in each]), axis=0) for key in each[0]}
    out["epochs"] = np.array([m["step"].sum() for m in each])
    return out


def summarize(plan: balancer.Plan, layout: str, reps: list[list[list[dict]]], cost, clock: str) -> dict:
    """One plan's row: epoch times (median over the repetitions, each repetition's kept), the step by step medians
    split into compute, all-reduce and optimizer, and the prediction's error against those medians."""
    t = plan.topology
    wall, cpu = (median_times(reps, t.dp, t.cp, c) for c in (0, 1))
    main = cpu if clock == "cpu" else wall
    prediction = plan.predict(cost, layout=layout)
    tokens = int((plan.end - plan.start).sum())
    step_tokens = plan.micro_batch_tokens().sum(axis=(1, 2))
    epoch_wall, epoch_cpu = float(np.median(wall["epochs"])), float(np.median(cpu["epochs"]))
    return {
        "layout": layout if t.cp > 1 else "none (cp 1)",
        "num_steps": plan.num_steps,
        "tokens": tokens,
        "mean_tokens_per_step": float(step_tokens[:-1].mean() if len(step_tokens) > 1 else step_tokens[0]),
        "epoch_wall_seconds": epoch_wall,
        "epoch_cpu_seconds": epoch_cpu,
        "reps_epoch_wall_seconds": wall["epochs"].tolist(),
        "reps_epoch_cpu_seconds": cpu["epochs"].tolist(),
        "tokens_per_second_wall": tokens / epoch_wall,
        "tokens_per_second_cpu": tokens / epoch_cpu,
        "epoch_seconds": epoch_cpu if clock == "cpu" else epoch_wall,
        "compute_seconds": float(main["compute"].sum()),
        "all_reduce_seconds": float(main["all_reduce"].sum()),
        "optimizer_seconds": float(main["opt"].sum()),
        "wall_over_cpu": epoch_wall / epoch_cpu,
        "predicted_compute_seconds": float(prediction["step_time_total"]),
        "micro_batch_error": error_summary(prediction["micro_batch_times"].ravel(), main["micro_batch"].ravel()),
        "step_compute_error": error_summary(prediction["step_times"], main["compute"]),
        "kv_tokens_moved": prediction["kv_tokens_moved"],
        "measured_step_seconds": main["step"].tolist(),
        "measured_compute_seconds": main["compute"].tolist(),
        "predicted_step_seconds": prediction["step_times"].tolist(),
    }


def paired(rows: dict, a: str, b: str, clock: str) -> dict:
    """How much faster `a`'s epoch was than `b`'s on `clock` ("wall" or "cpu"): the median of the per-repetition
    ratios (b / a), their min and max, and a verdict: `a` or `b` faster in every repetition, else within noise."""
    key = f"reps_epoch_{clock}_seconds"
    ratios = np.array(rows[b].get(key, [rows[b][f"epoch_{clock}_seconds"]])) / np.array(
        rows[a].get(key, [rows[a][f"epoch_{clock}_seconds"]])
    )
    verdict = f"{a} faster" if (ratios > 1).all() else f"{b} faster" if (ratios < 1).all() else "within noise"
    return {
        "median": float(np.median(ratios)),
        "min": float(ratios.min()),
        "max": float(ratios.max()),
        "reps": len(ratios),
        "verdict": verdict,
    }


def compare(rows: dict, base: str, clock: str = "cpu") -> dict:
    """Speedups over `base` (measured: the median of the per-repetition ratios of epoch times, on the figures'
    clock and by wall clock and by CPU time apart, with their spread; predicted: compute), every pair of plans on both
    clocks (`pairs`: paired ratio and verdict) and the rankings (of the median epochs: figures' clock, wall clock,
    CPU time; predicted). `clock`: the figures' clock, "cpu" or "wall"."""
    for name, row in rows.items():
        for c in ("wall", "cpu"):
            ratio = paired(rows, name, base, c)
            row[f"measured_speedup_{c}"] = ratio["median"]
            row[f"measured_speedup_{c}_spread"] = [ratio["min"], ratio["max"]]
        row["measured_speedup"] = row[f"measured_speedup_{clock}"]
        row["measured_compute_speedup"] = rows[base]["compute_seconds"] / row["compute_seconds"]
        row["predicted_speedup"] = rows[base]["predicted_compute_seconds"] / row["predicted_compute_seconds"]
    names = list(rows)
    pairs = {
        f"{a} vs {b}": {c: paired(rows, a, b, c) for c in ("wall", "cpu")}
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    measured = sorted(rows, key=lambda k: rows[k]["epoch_seconds"])
    predicted = sorted(rows, key=lambda k: rows[k]["predicted_compute_seconds"])
    return {
        "baseline": base,
        "rows": rows,
        "pairs": pairs,
        "ranking_measured": measured,
        "ranking_measured_wall": sorted(rows, key=lambda k: rows[k]["epoch_wall_seconds"]),
        "ranking_measured_cpu": sorted(rows, key=lambda k: rows[k]["epoch_cpu_seconds"]),
        "ranking_predicted": predicted,
        "ranking_correct": measured == predicted,
    }


def run(name: str, lengths: np.ndarray, cost, clock: str, args) -> dict:
    """One run of RUNS: plan, then train every plan's epoch `args.reps` times (a fresh world each, the order of the
    plans within a step rotating), then the rows and comparisons over the repetitions."""
    dp, cp, max_tokens, configs = RUNS[name]
    topo = balancer.Topology(dp=dp, cp=cp, micro_batches=args.micro_batches, max_tokens=max_tokens)
    plans = {p: PLANNERS[p](lengths, topo, cost, seed=args.seed) for p in {c[1] for c in configs}}
    payload = {label: step_payload(plans[p], layout) for label, p, layout in configs}
    load_before, t0 = [round(x, 2) for x in os.getloadavg()], time.perf_counter()
    reps, loads = [], []
    for rep in range(args.reps):
        reps.append(train(payload, dp, cp, args.threads, offset=rep))
        loads.append(round(os.getloadavg()[0], 2))
        print(f"{name}: repetition {rep + 1}/{args.reps} done, load {loads[-1]}", flush=True)
    info = {"seconds": time.perf_counter() - t0, "load_before": load_before, "reps": args.reps, "rep_loads": loads}
    info["load_after"] = [round(x, 2) for x in os.getloadavg()]
    rows = {label: summarize(plans[p], layout, [r[label] for r in reps], cost, clock) for label, p, layout in configs}
    out = compare(rows, configs[0][0] if name == "layout" else "trl-bfd", "cpu" if clock == "cpu" else "wall")
    return {"topology": topo.to_dict(), "processes": dp * cp, "cores": os.cpu_count(), **info, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=6_000, help="documents drawn from the trace (all plans)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5, help="repetitions of every run (paired: all plans in each)")
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--quick", action="store_true", help="300 documents, 2 repetitions (a test run; not written)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    args.reps = 2 if args.quick else args.reps
    if not COST_FILE.exists():
        sys.exit(f"{COST_FILE} is missing: run benchmarks/calibration.py first")
    cost = balancer.CostModel.load(COST_FILE)
    calibration = json.loads(COST_FILE.read_text()).get("report", {})
    clock = calibration.get("clock", "cpu")
    lengths = documents(300 if args.quick else args.documents, args.seed)
    runs = {name: run(name, lengths, cost, clock, args) for name in args.runs}
    payload = {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "scale": SCALE,
        "clock_of_figures": clock,
        "clock_reason": f"the calibrated model's clock ({calibration.get('clock_reason', 'no reason recorded')})",
        "cost_model": cost.to_dict(),
        "runs": runs,
    }
    for name, result in runs.items():
        print_table(name, result)
    if not args.quick:
        print(f"wrote {write_result('replay', payload, clock='wall+process_cpu', model=TINY_LLAMA)}")


def print_table(name: str, result: dict) -> None:
    print(f"{name}: {result['processes']} processes, load {result['load_before']} -> {result['load_after']}")
    print(
        f"{'plan':>16} {'steps':>5} {'tok/step':>8} {'epoch s':>8} {'compute':>8} {'speedup':>7} {'pred':>6} {'w/c':>5}"
    )
    for label, r in result["rows"].items():
        print(
            f"{label:>16} {r['num_steps']:5d} {r['mean_tokens_per_step']:8.0f} {r['epoch_seconds']:8.2f} "
            f"{r['compute_seconds']:8.2f} {r['measured_speedup']:7.3f} {r['predicted_speedup']:6.3f} "
            f"{r['wall_over_cpu']:5.2f} wall {r['measured_speedup_wall']:.3f}x cpu {r['measured_speedup_cpu']:.3f}x"
        )
    print(f"ranking measured {result['ranking_measured']}, predicted {result['ranking_predicted']}")
    for pair, clocks in result["pairs"].items():
        print(
            f"  {pair}: "
            + "; ".join(
                f"{c} {r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f}, {r['reps']} reps): {r['verdict']}"
                for c, r in clocks.items()
            )
        )


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def _speedup_cell(row: dict, clock: str) -> str:
    """A measured speedup: the median of the per-repetition ratios, with their min-max where repetitions ran."""
    cell = tb.fmt(row.get(f"measured_speedup_{clock}"), ".3f") + "x"
    spread = row.get(f"measured_speedup_{clock}_spread")
    return cell + (f" ({spread[0]:.3f}-{spread[1]:.3f}x)" if spread else "")


def _replay_table(data: dict, run: dict) -> str:
    """One run's plans: the epoch by wall clock and by CPU time (each step the slowest rank's), the speedups over
    the baseline on both clocks, the prediction and its error (on the figures' clock), then how it was measured."""
    clock = data["clock_of_figures"]
    rows = []
    for name, row in run["rows"].items():
        error = row.get("micro_batch_error") or {}
        rows.append(
            [
                name,
                row["layout"],
                str(row["num_steps"]),
                tb.fmt(row["mean_tokens_per_step"], ",.0f"),
                tb.fmt(row["epoch_wall_seconds"], ".1f"),
                tb.fmt(row["epoch_cpu_seconds"], ".1f"),
                _speedup_cell(row, "wall"),
                _speedup_cell(row, "cpu"),
                tb.fmt(row["predicted_speedup"], ".3f") + "x",
                tb.fmt(row["all_reduce_seconds"] + row["optimizer_seconds"], ".2f"),
                tb.fmt(error.get("median_abs_error"), ".1%"),
            ]
        )
    base = run["baseline"]
    header = ["plan", "layout", "steps", "tokens/step", "epoch s (wall)", "epoch s (CPU)"]
    header += [f"speedup vs {base} (wall)", f"speedup vs {base} (CPU)", "predicted speedup"]
    header += [f"all-reduce + optimizer s ({clock})", f"median micro-batch error ({clock})"]
    topo = run["topology"]
    ranking = (
        f"dp {topo['dp']} x cp {topo['cp']}, M = {topo['micro_batches']}, {run['processes']} processes at once on "
        f"{run.get('cores', '?')} cores; load average {run['load_before'][0]} before, {run['load_after'][0]} after; "
        f"{run['seconds']:.0f} s wall, {run.get('reps', 1)} repetitions (epoch times and speedups: medians; "
        f"speedups of the paired per-repetition ratios, min-max in brackets). Measured ranking ({clock}): "
        f"{', '.join(run['ranking_measured'])}; by wall "
        f"clock: {', '.join(run.get('ranking_measured_wall', ['not recorded']))}; predicted: "
        f"{', '.join(run['ranking_predicted'])} (ranking_correct, {clock}: {str(run['ranking_correct']).lower()})."
    )
    return tb.markdown(header, rows) + "\n\n" + ranking + _measured_line(data)


def table_replay() -> str:
    data = tb.load("replay")
    return _replay_table(data, data["runs"]["dp2"])


def table_replay_layout() -> str:
    data = tb.load("replay")
    return _replay_table(data, data["runs"]["layout"])


def table_replay_pairs() -> str:
    """Every pair of plans of both runs on both clocks: the median of the per-repetition ratios of their epochs, the
    spread, and what holds (one faster in every repetition, or within noise)."""
    data = tb.load("replay")
    rows = []
    for run_name, run in data["runs"].items():
        for pair, clocks in run.get("pairs", {}).items():
            for clock, r in clocks.items():
                a, b = pair.split(" vs ")
                rows.append([run_name, a, b, {"cpu": "CPU", "wall": "wall"}[clock], f"{r['median']:.3f}x",
                             f"{r['min']:.3f}-{r['max']:.3f}x", str(r["reps"]), r["verdict"]])  # fmt: skip
    header = ["run", "plan a", "plan b", "clock", "b's epoch / a's: median", "min-max", "repetitions", "what holds"]
    return tb.markdown(header, rows) + _measured_line(data)


def _measured_line(data: dict) -> str:
    """The record's measuring line with its commit, as every replay table ends."""
    commit = (data.get("git") or {}).get("commit")
    return tb.record_line(data)[:-1] + (f"; commit {commit[:10]}." if commit else ".")


def _held(pair: dict, faster: str) -> str:
    """A paired ratio on one clock, as "1.084x (1.02-1.11x): a faster in every repetition" or "within noise"."""
    verdict = pair["verdict"]
    holds = "within noise" if verdict == "within noise" else f"{verdict} in all {pair['reps']} repetitions"
    return f"{pair['median']:.3f}x ({pair['min']:.3f}-{pair['max']:.3f}x; {holds})"


def table_replay_summary() -> str:
    """What the replay says, from the record: the paired comparisons on each clock, step counts, the layout gain
    and the K/V tokens it moves, the prediction's absolute error (docs/cost-model.md)."""
    data = tb.load("replay")
    dp2, layout = data["runs"]["dp2"], data["runs"]["layout"]
    rows, lrows = dp2["rows"], layout["rows"]
    every = [*rows.values(), *lrows.values()]
    ratio = [r["wall_over_cpu"] for r in every]
    loads = [x for run in (dp2, layout) for x in (run["load_before"][0], run["load_after"][0])]
    ours, trl, tc = rows["balancer"], rows["trl-bfd"], rows["token-count"]
    overhead = [r["all_reduce_seconds"] + r["optimizer_seconds"] for r in rows.values()]
    zig, hyb = lrows["balancer+zigzag"], lrows["balancer+hybrid"]
    mean_err = [r["micro_batch_error"]["mean_error"] for r in every]
    mb_err = [r["micro_batch_error"]["median_abs_error"] for r in every]
    step_err = [r["step_compute_error"]["median_abs_error"] for r in every]
    clock = data["clock_of_figures"]
    vs_trl, vs_tc = tb.paired_ratio(dp2, "balancer", "trl-bfd"), tb.paired_ratio(dp2, "balancer", "token-count")
    vs_zig = tb.paired_ratio(layout, "balancer+hybrid", "balancer+zigzag")
    return (
        f"What the replay says ({dp2.get('reps', 1)} paired repetitions of each run; wall time was "
        f"{min(ratio):.1f}-{max(ratio):.1f} times the CPU time, load average {min(loads):g}-{max(loads):g} on "
        f"{dp2['cores']} cores; the figures' clock: {clock}):\n\n"
        f"- Equal layouts, this planner against TRL BFD packing: by CPU time "
        f"{_held(vs_trl['cpu'], 'balancer')}, by wall clock "
        f"{_held(vs_trl['wall'], 'balancer')}; predicted {ours['predicted_speedup']:.3f}x. "
        f"It made {ours['num_steps']} steps of about {ours['mean_tokens_per_step'] / 1e3:.0f}K tokens against TRL's "
        f"{trl['num_steps']} of about {trl['mean_tokens_per_step'] / 1e3:.0f}K. Against token-count packing "
        f"(predicted {ours['predicted_speedup'] / tc['predicted_speedup']:.3f}x): by CPU time "
        f"{_held(vs_tc['cpu'], 'balancer')}, by wall clock "
        f"{_held(vs_tc['wall'], 'balancer')}. Ranking of the median epochs by "
        f"{clock}: {', '.join(dp2['ranking_measured'])}; predicted: {', '.join(dp2['ranking_predicted'])}. The "
        f"all-reduce and optimizer steps cost {min(overhead):.2f}-{max(overhead):.2f} s per epoch.\n"
        f"- Layout gain, separately: the hybrid layout against zigzag at CP 2 on the same micro-batches, by CPU time "
        f"{_held(vs_zig['cpu'], 'balancer+hybrid')}, by wall clock "
        f"{_held(vs_zig['wall'], 'balancer+hybrid')}; predicted "
        f"{hyb['predicted_speedup']:.3f}x, moving {zig['kv_tokens_moved'] / max(hyb['kv_tokens_moved'], 1):.1f}x "
        f"fewer K/V tokens ({hyb['kv_tokens_moved']:,.0f} against {zig['kv_tokens_moved']:,.0f} token-hops).\n"
        f"- Absolute times ({clock}): mean micro-batch error {min(mean_err):+.0%} to {max(mean_err):+.0%} (negative: "
        f"the model predicts less than was measured); median |error| {min(mb_err):.0%}-{max(mb_err):.0%} per "
        f"micro-batch, {min(step_err):.0%}-{max(step_err):.0%} per step." + _measured_line(data)
    )


TABLES = {  # docs/ marker name -> the table, from the record
    "replay": table_replay,
    "replay_layout": table_replay_layout,
    "replay_pairs": table_replay_pairs,
    "replay_summary": table_replay_summary,
}


if __name__ == "__main__":
    main()
