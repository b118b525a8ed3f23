"""Measured balance on real uneven CPU ranks: static plans (the monitor in shadow mode) against adapt mode.

Four ranks (dp 4, M 2, 8192 tokens per micro-batch, a step budget of 0.375 of what the ranks hold; or dp 2 x cp 2
for `cp2`) train a tiny attention-heavy Llama (balancer.calibration.TINY_LLAMA, one thread per rank) on documents
with the lengths of the published wlbllm trace (lengths // 16, at least 16; random token ids) through
`BalancedBatchSampler` and `BalanceMonitor`, starting from the cost model a user has without calibrating
(`CostModel.from_config`, FLOPs). Ranks are pinned with
`os.sched_setaffinity`: `uneven` puts rank 0 alone on core 0 and ranks 1-3 together on core 1 (a real 3x speed
difference, not a sleep: ideal gain of planning by speed 1.5x, for which rank 0 must take half of a step's work:
the step budget leaves it that room, see FILL); `equal` puts two ranks on each core; `cp2` is dp 2 x cp 2, two
ranks per core, for the prediction error under CP; `dynamic` is dp 2 x cp 2 with dynamic CP (groups of 1, 2 or 4
pool ranks per slot) on the uneven cores: speeds per pool rank, a group at its slowest member's. A step: every
micro-batch of the rank's replica (its group's in each slot, dynamic CP; forward + backward timed by the monitor,
gradients accumulated), one all-reduce of the gradients (timed apart), the AdamW step, `monitor.end_step()`; its
wall time runs from a barrier before it to the end of `end_step`.

One spawned world per configuration runs `--pairs` pairs of epochs, static and adapt alternating (which goes first
alternates too), each epoch with a fresh model, sampler and monitor over the same documents, so load changes reach
both alike; with `--interleave` the two epochs of a pair run step by step in alternation (which goes first
alternates every step), so the two plans of a step are timed within a second of each other. Figures (steps after
the second window, where adapt's first refit plans): the mean step wall time (slowest rank), measured imbalance,
prediction error before (the sampler's model at its best scale) and after the refit (fresh micro-batches), the
monitor's own process CPU per step over the step's, and the refit's. The machine is shared with other jobs: the
load average is recorded at start and end.

    python benchmarks/measured_balance.py [--pairs 5] [--configs uneven,equal,cp2,dynamic] [--steps-per-window 4]
        [--windows 6] [--interleave] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
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
from _common import free_port, planner_takes_rank_speeds, write_result

SCALE = 16
MIN_LENGTH = 16  # a document alone in a micro-batch still gives every CP rank tokens (zigzag: 2 x cp chunks)
CONFIGS = {  # name: (dp, cp, cores of the ranks, pairs, cp_sizes: dynamic CP)
    "uneven": (4, 1, [0, 1, 1, 1], 3, None),
    "equal": (4, 1, [0, 0, 1, 1], 5, None),
    "cp2": (2, 2, [0, 1, 0, 1], 2, None),
    "dynamic": (2, 2, [0, 1, 1, 1], 3, (1, 2, 4)),
}
MAX_TOKENS, MICRO_BATCHES, WINDOWS, STEPS_PER_WINDOW = 8192, 2, 6, 4
# tokens per step as a share of what the ranks hold: a fast rank needs room to take its speed's share of the work
# (rank 0 alone on a core is 3-3.7x the others: 50-55% of the step, which 0.85 of capacity cannot give it;
# the monitor logs it when the fitted speeds ask for more than a replica holds)
FILL = 0.375
# steps per gather: half the collective's CPU per step; a fit still reaches every rank within 3 steps of its window's
# end, before the window it is for (two later) starts, as long as windows have 4 steps or more
GATHER_EVERY = 2


def _documents(n_windows: int, steps: int, dp: int, cp: int, fill: float = FILL):
    from balancer.data.traces import load_trace

    lengths = np.maximum(MIN_LENGTH, np.asarray(load_trace("wlbllm")) // SCALE)
    lengths = lengths[np.random.default_rng(0).permutation(len(lengths))]
    lengths = lengths[lengths <= MAX_TOKENS * cp]
    tokens_per_step = int(fill * dp * cp * MICRO_BATCHES * MAX_TOKENS)
    per_window = int(steps * tokens_per_step / lengths.mean())
    return lengths[: n_windows * per_window].copy(), per_window, tokens_per_step


class _Epoch:
    """One epoch of one mode on this rank: a fresh model, sampler and monitor over `lengths`; `step()` runs the
    next step (False when the epoch is over), `result()` the figures."""

    def __init__(self, rank, dp, cp, mode, lengths, window_docs, tps, seed, groups, every=1, cp_sizes=None):
        import torch

        import balancer
        from balancer.calibration import TINY_LLAMA, build_model
        from balancer.measured import BalanceMonitor

        topo = balancer.Topology(dp=dp, cp=cp, micro_batches=MICRO_BATCHES, max_tokens=MAX_TOKENS,
                                 tokens_per_step=tps, cp_sizes=cp_sizes)  # fmt: skip
        cost = balancer.CostModel.from_config(TINY_LLAMA)
        self.sampler = balancer.BalancedBatchSampler(lengths, topo, cost, rank=rank, seed=seed, window_docs=window_docs)
        self.monitor = BalanceMonitor(self.sampler, mode="adapt" if mode == "adapt" else "shadow", warmup_steps=1,
                                      min_samples=16, every=every)  # fmt: skip
        torch.manual_seed(seed)
        self.model = build_model(TINY_LLAMA)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.lengths, self.cp, self.cp_sizes, self.groups, self.seed = lengths, cp, cp_sizes, groups, seed
        self.replica, self.cp_rank = divmod(rank, cp)
        self.steps, self.walls, self.cpus = [], [], []
        self.it = iter(self.sampler)

    def step(self) -> bool:
        import torch
        import torch.distributed as dist
        from _replay_worker import _run_micro_batch

        batch = [next(self.it, None) for _ in range(MICRO_BATCHES)]
        if batch[0] is None:
            return False
        step, sampler, monitor, model = len(self.steps), self.sampler, self.monitor, self.model
        window = sampler.windows.locate(step)[0]
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        tokens = sampler.step_loss_tokens(step)
        for j, mb in enumerate(batch):
            sizes = [(i.end - i.start) if hasattr(i, "end") else int(self.lengths[i]) for i in mb]
            size, rank_in, group = self.cp, self.cp_rank, self.groups.get((self.replica * self.cp, self.cp))
            if self.cp_sizes is not None and len(mb):  # dynamic CP: this slot's group
                g = mb[0].group
                size, rank_in, group = g.size, g.rank, self.groups.get((g.start, g.size))
            with monitor.timer():
                if sizes:  # (a dynamic slot may leave a group without documents)
                    seed = self.seed + 97 * step + j
                    _run_micro_batch(model, sizes, "zigzag", size, rank_in, group, 1 / tokens, seed)
        r0 = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        dist.all_reduce(flat)
        offset = 0
        for p in (p for p in model.parameters() if p.grad is not None):
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        reduce = time.perf_counter() - r0
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        monitor.end_step()
        self.walls.append(time.perf_counter() - w0)
        self.cpus.append(time.process_time() - c0)
        self.steps.append({"window": int(window), "reduce": reduce})
        return True

    def result(self) -> dict:
        monitor = self.monitor
        monitor.flush()  # the steps not gathered yet (every > 1)
        report = monitor.report()
        report.pop("series")
        replica = [[s["window"], s["measured"]] for s in monitor.ledger.steps]
        return {"steps": self.steps, "wall": self.walls, "cpu": self.cpus, "report": report,
                "replica_times": replica, "planned_speeds": _planned_speeds(self.sampler),
                "micro_batches": _micro_batches(monitor), "micro_batch_sizes": _micro_batch_sizes(monitor)}  # fmt: skip


def _pair(order: tuple, interleave: bool, *args) -> dict:
    """{mode: result} of one pair: the two epochs one after the other in `order`, or with `interleave` step by step
    (the first of `order` first on even steps, the other on odd ones: both plans have the same step counts)."""
    epochs = {mode: _Epoch(*args[:3], mode, *args[3:]) for mode in order}
    if not interleave:
        for mode in order:
            while epochs[mode].step():
                pass
        return {mode: epochs[mode].result() for mode in order}
    k = 0
    while True:
        first, second = order if k % 2 == 0 else order[::-1]
        more = epochs[first].step()
        if more != epochs[second].step():
            raise RuntimeError("the static and adapt epochs have different step counts")
        if not more:
            return {mode: epochs[mode].result() for mode in order}
        k += 1


def _micro_batches(monitor) -> list:
    """Every measured micro-batch but warm-up: [ledger step, step, window, replica, m, tokens, pieces, seconds,
    predicted by the first accepted fit, measured after that fit (0/1)] (no fit: predicted NaN, fresh 0)."""
    from balancer.measured.report import sample_predictions

    led = monitor.ledger
    fitted = [m for m in monitor.models if m.in_seconds]
    keep = [(i, s) for i, s in enumerate(led.samples) if not s[5] and s[4] > 0]
    if not keep:
        return []
    m_of = [r[6] for r in led.mb][-len(led.samples) :]
    pred = np.full(len(keep), np.nan)
    fresh_from = 10**9
    if fitted:
        pred = sample_predictions(monitor, fitted[0], [s for _, s in keep])
        fresh_from = fitted[0].fresh_from
    return [[s[0], led.steps[s[0]]["step"], led.steps[s[0]]["window"], s[1], m_of[i], sum(s[3]), len(s[3]), s[4],
             float(p), int(s[0] >= fresh_from)] for (i, s), p in zip(keep, pred)]  # fmt: skip


def _micro_batch_sizes(monitor) -> list:
    """The piece token counts of every row of `_micro_batches`, in the same order (for offline fits)."""
    return [[int(x) for x in s[3]] for s in monitor.ledger.samples if not s[5] and s[4] > 0]


def _fresh_errors(rows: list) -> dict:
    """The first accepted fit's error on the micro-batches measured after it (none of them in its evidence), the
    report's outlier rule applied: |measured - predicted| / measured, and the same after dividing out each step's
    median measured / predicted ratio (a speed change of the whole machine between steps, which no per-micro-batch
    model can know and which moves every rank alike)."""
    from balancer.measured.refit import outlier_mask

    a = np.array([r for r in rows if r[9]], dtype=np.float64).reshape(-1, 10)
    if not len(a):
        return {"micro_batches": 0}
    seconds, pred = a[:, 7], a[:, 8]
    out = outlier_mask(seconds, pred, a[:, 3])
    raw = np.abs(pred - seconds) / seconds
    scaled = pred.copy()
    for step in np.unique(a[:, 0]):
        k = a[:, 0] == step
        scaled[k] *= np.median(seconds[k] / pred[k])
    rel = np.abs(scaled - seconds) / seconds
    q = lambda e: [float(np.median(e)), float(np.quantile(e, 0.9))]  # noqa: E731
    return {"micro_batches": int(len(a)), "outliers": int(out.sum()), "median_p90": q(raw[~out]),
            "within_step_median_p90": q(rel[~out]), "median_seconds": float(np.median(seconds))}  # fmt: skip


def _planned_speeds(sampler):
    topo = sampler.windows.model(sampler.windows.count - 1)[0]
    return list(getattr(topo, "rank_speeds", None) or []) or None


def _worker(rank, world, port, payload, out):
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {payload["cores"][rank] % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30))  # fmt: skip
    try:
        dp, cp = payload["dp"], payload["cp"]
        if payload["cp_sizes"] is None:  # {(start, size): group} of this rank's CP groups
            groups = {(r * cp, cp): dist.new_group(list(range(r * cp, (r + 1) * cp))) for r in range(dp)}
        else:
            import balancer

            topo = balancer.Topology(dp=dp, cp=cp, micro_batches=MICRO_BATCHES, max_tokens=MAX_TOKENS,
                                     cp_sizes=tuple(payload["cp_sizes"]))  # fmt: skip
            groups = balancer.cp_groups(topo)
        lengths = np.asarray(payload["lengths"], dtype=np.int64)
        runs = []
        for pair in range(payload["pairs"]):
            order = ("static", "adapt") if pair % 2 == 0 else ("adapt", "static")
            load = os.getloadavg()[0]
            results = _pair(order, payload["interleave"], rank, dp, cp, lengths, payload["window_docs"],
                            payload["tps"], pair, groups, payload["every"], payload["cp_sizes"])  # fmt: skip
            for mode in order:
                runs.append({"pair": pair, "mode": mode, "load_1min": load, **results[mode]})
                if rank == 0:
                    wall = np.mean(results[mode]["wall"])
                    print(f"  pair {pair} {mode}: {wall:.3f} s/step, load {load:.1f}", flush=True)
        Path(f"{out}.{rank}").write_text(json.dumps(runs))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _after(run, first_window=2):
    return [i for i, s in enumerate(run["steps"]) if s["window"] >= first_window]


def _summarise(name, per_rank, dp, cp):
    runs = []
    for k, run0 in enumerate(per_rank[0]):
        idx = _after(run0)
        wall = np.max([np.array(r[k]["wall"]) for r in per_rank], axis=0)
        cpu = np.array([np.array(r[k]["cpu"]) for r in per_rank])
        mon = np.mean([r[k]["report"]["monitor_cpu_seconds"] for r in per_rank])
        rep = run0["report"]
        models = rep["models"]
        runs.append({
            "pair": run0["pair"], "mode": run0["mode"], "load_1min_at_start": run0["load_1min"],
            "steps": len(wall), "steps_after_second_window": len(idx),
            "mean_step_seconds": float(wall[idx].mean()),
            "mean_step_process_cpu_per_rank": cpu[:, idx].mean(axis=1).tolist(),
            "measured_imbalance": rep["measured_imbalance"],
            "measured_imbalance_after_second_window": _imbalance_after(run0),
            "prediction_error_before": [models[0]["prediction_error_median"], models[0]["prediction_error_p90"]],
            "prediction_error_after_refit": [rep["fresh_error_median"], rep["fresh_error_p90"]],
            "after_first_refit": _fresh_errors(run0["micro_batches"]),
            "token_bound": rep["token_bound"],
            "rank_speeds_fitted": rep["rank_speeds"], "rank_speeds_planned": run0["planned_speeds"],
            "refits": [{k2: v for k2, v in r.items() if k2 in ("window", "accepted", "reason", "cpu_seconds")}
                       for r in rep["refits"]],
            "monitor_cpu_fraction": float(mon / cpu.sum(axis=1).mean()),
            "refit_cpu_seconds": rep["refit_cpu_seconds"],
            "attainable": _attainable(run0, wall, idx, rep) if cp == 1 else None,
            "micro_batches": run0["micro_batches"], "micro_batch_sizes": run0["micro_batch_sizes"],
        })  # fmt: skip
    pairs = []
    for p in sorted({r["pair"] for r in runs}):
        s = next(r for r in runs if r["pair"] == p and r["mode"] == "static")
        a = next(r for r in runs if r["pair"] == p and r["mode"] == "adapt")
        best = a["attainable"]
        pairs.append({"pair": p, "speedup": s["mean_step_seconds"] / a["mean_step_seconds"],
                      "static_s": s["mean_step_seconds"], "adapt_s": a["mean_step_seconds"],
                      "attainable_speedup": s["mean_step_seconds"] / best["step_seconds"] if best else None,
                      "divisible_speedup": s["mean_step_seconds"] / best["divisible_step_seconds"] if best else None,
                      **_control(s["micro_batches"], a["micro_batches"])})  # fmt: skip
    speedups = [p["speedup"] for p in pairs]
    return {"config": name, "dp": dp, "cp": cp, "runs": runs, "pairs": pairs,
            "speedup_median": float(np.median(speedups)), "speedup_min": float(np.min(speedups))}  # fmt: skip


ATTAINABLE_RULE = (
    "per step (after the second window): the replicas' measured compute weighed by the run's fitted speeds and "
    "shared out in proportion to them (sum(t_r * s_r) / sum(s_r)), but at least the step's costliest document on "
    "the fastest replica (its measured micro-batch time times its share of that micro-batch's cost under the "
    "fitted model, times s_r / max(s): a document is not split at CP 1), plus the step's measured time outside "
    "the replicas' compute (gradient all-reduce, optimizer, gathers), as measured; `divisible` leaves the document "
    "floor out"
)


def _attainable(run, wall: np.ndarray, idx: list, report: dict) -> dict | None:
    """The best mean step time any plan of this run's steps could reach on these ranks, from the run's own
    measurements (ATTAINABLE_RULE): what the speedup is judged against, since indivisible documents and the step's
    fixed part keep it from the speed ratio's ideal. Over the steps `idx` (those of `mean_step_seconds`; a step
    without measurements, the short last one, counts at its wall time). None without fitted speeds; only for CP 1
    (with CP a document is split)."""
    from balancer.planning.cost.model import CostModel

    speeds = report["rank_speeds"]
    if speeds is None:
        return None
    s = np.asarray(speeds, dtype=np.float64)
    cost = CostModel.from_dict(report["cost"])
    per_step: dict = {}  # step -> [compute per replica, floor]
    for row, sizes in zip(run["micro_batches"], run["micro_batch_sizes"]):
        if row[2] < 2:
            continue
        step, replica, seconds = int(row[1]), int(row[3]), row[7]
        times, floor = per_step.setdefault(step, [np.zeros(len(s)), 0.0])
        times[replica] += seconds
        doc = cost.cost(np.asarray(sizes))
        share = float(doc.max() / (doc.sum() + cost.fixed))
        per_step[step][1] = max(floor, seconds * share * s[replica] / s.max())
    steps = [k for k in idx if k in per_step]
    if not steps:
        return None
    balanced = np.array([float(per_step[k][0] @ s / s.sum()) for k in steps])
    floors = np.array([per_step[k][1] for k in steps])
    rest = np.array([wall[k] - per_step[k][0].max() for k in steps])  # measured, in the run's own steps
    unmeasured = float(sum(wall[k] for k in idx if k not in per_step))

    def mean(compute):
        return float((np.sum(compute + rest) + unmeasured) / len(idx))

    return {"step_seconds": mean(np.maximum(balanced, floors)), "divisible_step_seconds": mean(balanced),
            "outside_compute_seconds": float(rest.mean()), "steps_floor_bound": int(np.sum(floors > balanced)),
            "steps": len(idx), "speeds": speeds, "rule": ATTAINABLE_RULE}  # fmt: skip


def _control(static: list, adapt: list) -> dict:
    """The noise the pair's comparison lives in: the two epochs plan their first two windows alike (the first fit
    plans from the third), so the static / adapt ratio of the slowest replica's measured compute per step there
    should be 1, and every micro-batch of them ran twice. Gives that ratio, the same ratio from the third window on
    (where the plans differ), and the median |log| of the two times of one micro-batch (rows: `_micro_batches`)."""

    def compute(rows, early):
        per = {}
        for r in rows:
            if (r[2] < 2) == early:
                per.setdefault(r[0], {}).setdefault(r[3], 0.0)
                per[r[0]][r[3]] += r[7]
        return float(np.mean([max(v.values()) for v in per.values()])) if per else float("nan")

    def times(rows):
        return {(r[1], r[3], r[4]): (r[7], r[5], r[6]) for r in rows if r[2] < 2}

    ts, ta = times(static), times(adapt)
    same = [np.log(ts[k][0] / ta[k][0]) for k in ts if k in ta and ts[k][1:] == ta[k][1:]]
    return {"same_plan_compute_ratio": compute(static, True) / compute(adapt, True),
            "compute_ratio_after_second_window": compute(static, False) / compute(adapt, False),
            "same_micro_batch_twice_median_abs_log": float(np.median(np.abs(same))) if same else float("nan"),
            "same_micro_batches": len(same)}  # fmt: skip


def _imbalance_after(run) -> float:
    """Mean over the steps after the second window of the slowest replica's measured compute over the replicas'
    mean (the monitor's ledger)."""
    t = np.array([m for w, m in run["replica_times"] if w >= 2])
    return float((t.max(axis=1) / t.mean(axis=1)).mean()) if len(t) else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pairs", type=int, help="static/adapt pairs per configuration (default: uneven 3, equal 5, cp2 2)"
    )
    ap.add_argument("--configs", default="uneven,equal,cp2", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="1 pair, 2 steps per window (a smoke run)")
    ap.add_argument("--output", default="measured_balance", help="results name (benchmarks/results/NAME.json)")
    ap.add_argument(
        "--steps-per-window", type=int, default=STEPS_PER_WINDOW,
        help=f"steps per planning window (default {STEPS_PER_WINDOW}): the first refit's evidence is one window",
    )  # fmt: skip
    ap.add_argument(
        "--interleave", action="store_true",
        help="run a pair's two epochs step by step in alternation (which goes first alternates) instead of one "
        "after the other: both see the machine of the same seconds",
    )  # fmt: skip
    ap.add_argument("--windows", type=int, default=WINDOWS, help=f"planning windows per epoch (default {WINDOWS})")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from balancer.calibration import TINY_LLAMA

    steps = 2 if args.quick else args.steps_per_window
    every = GATHER_EVERY if steps >= 4 else 1  # (see GATHER_EVERY)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results, t0 = [], time.perf_counter()
    for name in args.configs.split(","):
        dp, cp, cores, pairs, cp_sizes = CONFIGS[name]
        pairs = 1 if args.quick else (args.pairs or pairs)
        lengths, window_docs, tps = _documents(args.windows, steps, dp, cp)
        payload = {"dp": dp, "cp": cp, "cores": cores, "lengths": lengths.tolist(), "window_docs": window_docs,
                   "tps": tps, "pairs": pairs, "every": every, "cp_sizes": cp_sizes,
                   "interleave": args.interleave}  # fmt: skip
        print(f"{name}: dp{dp} x cp{cp}, cores {cores}, {len(lengths)} documents, windows of {window_docs}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r")
            mp.spawn(_worker, args=(dp * cp, free_port(), payload, out), nprocs=dp * cp, join=True)
            per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(dp * cp)]
        results.append({**_summarise(name, per_rank, dp, cp), "cp_sizes": cp_sizes})
        payload = {"configs": results, "planner_takes_rank_speeds": planner_takes_rank_speeds(),
                   "documents": f"wlbllm trace lengths // {SCALE} (at least {MIN_LENGTH}), random tokens",
                   "micro_batches": MICRO_BATCHES, "max_tokens": MAX_TOKENS, "windows": args.windows,
                   "steps_per_window": steps, "fill": FILL, "gather_every": every, "interleave": args.interleave,
                   "seconds": time.perf_counter() - t0}  # fmt: skip
        # written after every configuration (a later one that fails keeps the earlier ones)
        path = write_result(args.output, payload, clock="wall+process_cpu", model={"config": TINY_LLAMA, "threads": 1})
    for r in results:
        print(f"{r['config']}: speedup median {r['speedup_median']:.3f}, min {r['speedup_min']:.3f}")
    print(f"wrote {path}")
    return 0


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_measured_balance(name: str = "measured_balance") -> str:
    """Static (shadow) against adapt on pinned CPU ranks (benchmarks/measured_balance.py), per configuration."""
    data = tb.load(name)
    header = ["ranks", "pairs", "static s/step", "adapt s/step", "adapt speedup: median (min)",
              "attainable speedup: median (documents divisible)", "measured imbalance static / adapt",
              "prediction error before refit: median / p90",
              "after the first refit (fresh micro-batches): median / p90", "the same within steps",
              "fitted speeds (last adapt run)", "monitor CPU / step CPU", "refit CPU s",
              "1-min load during runs"]  # fmt: skip
    rows = []
    for c in data["configs"]:
        runs = {m: [r for r in c["runs"] if r["mode"] == m] for m in ("static", "adapt")}

        def med(mode, key, i=None):
            vals = [r[key] if i is None else r[key][i] for r in runs[mode]]
            vals = [v for v in vals if v is not None and v == v]
            return float(sorted(vals)[len(vals) // 2]) if vals else None

        def fresh(key, i):
            vals = sorted(r["after_first_refit"][key][i] for r in c["runs"] if key in r.get("after_first_refit", {}))
            return float(vals[len(vals) // 2]) if vals else None

        speeds = runs["adapt"][-1]["rank_speeds_fitted"]
        loads = [r["load_1min_at_start"] for r in c["runs"]]
        rows.append([
            f"{c['config']} (dp{c['dp']} x cp{c['cp']}{_cp_sizes_cell(c)})", str(len(c["pairs"])),
            tb.fmt(med("static", "mean_step_seconds")), tb.fmt(med("adapt", "mean_step_seconds")),
            f"{c['speedup_median']:.3f}x ({c['speedup_min']:.3f}x)", _attainable_cell(c["pairs"]),
            f"{tb.fmt(med('static', 'measured_imbalance_after_second_window'))} / "
            f"{tb.fmt(med('adapt', 'measured_imbalance_after_second_window'))}",
            f"{tb.fmt(med('static', 'prediction_error_before', 0), '.1%')} / "
            f"{tb.fmt(med('static', 'prediction_error_before', 1), '.1%')}",
            f"{tb.fmt(fresh('median_p90', 0), '.1%')} / {tb.fmt(fresh('median_p90', 1), '.1%')}",
            f"{tb.fmt(fresh('within_step_median_p90', 0), '.1%')} / "
            f"{tb.fmt(fresh('within_step_median_p90', 1), '.1%')}",
            "-" if speeds is None else ", ".join(f"{x:.2f}" for x in speeds),
            tb.fmt(max(r["monitor_cpu_fraction"] for r in c["runs"]), ".2%"),
            tb.fmt(max(r["refit_cpu_seconds"] for r in c["runs"]), ".2f"),
            f"{min(loads):.1f}-{max(loads):.1f}",
        ])  # fmt: skip
    note = (
        f"\n\nMedians over the pairs (a run's figures: the steps after its second window; errors: median over the "
        f"runs of each run's median and p90; monitor CPU and refit CPU: the largest run). Planner takes rank speeds: "
        f"{tb.fmt(data['planner_takes_rank_speeds'])}."
    )
    return tb.markdown(header, rows) + note + tb.record_line(data)


def _attainable_cell(pairs: list) -> str:
    """Median attainable speedup of the pairs (benchmarks/measured_balance.py ATTAINABLE_RULE) and the same with
    every document divisible; "-" where the run has none (CP > 1, or results from before it was measured)."""
    best = sorted(p["attainable_speedup"] for p in pairs if p.get("attainable_speedup"))
    divisible = sorted(p["divisible_speedup"] for p in pairs if p.get("divisible_speedup"))
    if not best:
        return "-"
    return f"{best[len(best) // 2]:.3f}x ({divisible[len(divisible) // 2]:.3f}x)"


def _cp_sizes_cell(config: dict) -> str:
    sizes = config.get("cp_sizes")
    return "" if not sizes else ", cp_sizes " + "/".join(str(x) for x in sizes)


TABLES = {  # docs/ marker name -> the table, from the record
    "measured_balance": table_measured_balance,
    "measured_balance_dynamic": lambda: table_measured_balance("measured_balance_dynamic"),
    "measured_balance_uneven_w10": lambda: table_measured_balance("measured_balance_uneven_w10"),
    "measured_balance_interleaved": lambda: table_measured_balance("measured_balance_interleaved"),
    "measured_balance_interleaved_cp": lambda: table_measured_balance("measured_balance_interleaved_cp"),
    "measured_balance_interleaved_cp2": lambda: table_measured_balance("measured_balance_interleaved_cp2"),
    "measured_balance_interleaved_e524781": lambda: table_measured_balance("measured_balance_interleaved@c02ed41"),
    "measured_balance_interleaved_cp_e524781": lambda: table_measured_balance(
        "measured_balance_interleaved_cp@c02ed41"
    ),
    "measured_balance_interleaved_unpermuted": lambda: table_measured_balance(
        "measured_balance_interleaved_unpermuted@6db6159"
    ),
    "measured_balance_interleaved_micro_batch_speeds": lambda: table_measured_balance(
        "measured_balance_interleaved_micro_batch_speeds@6db6159"
    ),
}


if __name__ == "__main__":
    sys.exit(main())
