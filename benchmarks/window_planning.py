"""Windowed planning: what a rank pays before its first micro-batch, and what windows cost in plan quality.

1. First micro-batch: a fresh child process memory-maps 30M document lengths (the wlbllm trace resampled, saved as
   int64 .npy), builds a rank's BalancedBatchSampler (dp64 x cp4 x M8 x 32,768) and takes one micro-batch; it reports
   its process CPU time and its peak RSS (VmHWM) above what it held before touching the lengths, less the lengths
   array itself (its mapped pages count in RSS). Run for windows of 16..128 steps' documents and the default; with
   `--whole-epoch`, also for one window (the plan of the whole epoch, what the sampler did before windows).
2. Quality: every row of the planner-quality benchmark (benchmarks/planner_quality.py: 4 traces x 3 topologies),
   planned whole and window by window (the window plans of an epoch concatenated into one plan); epoch efficiency
   of each against the whole-epoch plan, for the same window sizes (in steps' documents) and the default. The rows
   hold 78K-100K documents (17-1,927 steps), so large windows often hold the whole epoch: the same rows with each
   trace resampled to 256 steps' documents (at most 8x; sft has 1,927 steps already and is left out) are planned
   too, and draw the curve.
Writes benchmarks/results/window_planning.json and window_planning.png (loss vs memory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _render as tb
import numpy as np
from _common import DEFAULT_COST, RESULTS, TOPOLOGIES, standard_topology, write_result

import balancer
from balancer.data.traces import load_trace
from balancer.planning.shuffle import num_windows
from balancer.planning.window import DEFAULT_WINDOW_STEPS, default_window_docs, plan_window

STEPS = (16, 32, 64, 128)
SCALED_STEPS = 256  # the scaled rows: each trace resampled to at least this many steps' documents (at most 8x)
BIG = dict(dp=64, cp=4, pp=1, micro_batches=8, max_tokens=32768)


def _rss_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(path: str, window_docs: int | None) -> dict:
    """Runs in a fresh process: sampler + first micro-batch on the memory-mapped lengths."""
    import torch  # noqa: F401 - imported before the measurement, as a training process has it

    rss0 = _rss_kib("VmRSS")
    cpu0 = time.process_time()
    lengths = np.load(path, mmap_mode="r")
    topo = balancer.Topology(**BIG)
    sampler = balancer.BalancedBatchSampler(lengths, topo, DEFAULT_COST, dp_rank=17, seed=0, window_docs=window_docs)
    first = next(iter(sampler))
    cpu = time.process_time() - cpu0
    peak = _rss_kib("VmHWM")
    return {
        "window_docs": sampler.window_docs,
        "windows": sampler.num_windows,
        "steps_in_first_window": sampler.windows.steps(0),
        "first_micro_batch_docs": len(first),
        "cpu_seconds": round(cpu, 3),
        "peak_rss_above_start_mib": round((peak - rss0) / 1024, 1),
        "peak_rss_above_lengths_mib": round((peak - rss0) / 1024 - lengths.nbytes / 2**20, 1),
        "lengths_mib": round(lengths.nbytes / 2**20, 1),
        "children_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def child_scan(path: str) -> dict:
    """Runs in a fresh process: the one pass over the lengths every sampler makes (check, sum, fingerprint)."""
    from balancer.training.lengths import scan_lengths

    lengths = np.load(path, mmap_mode="r")
    cpu0 = time.process_time()
    scan_lengths(lengths)
    cpu = time.process_time() - cpu0
    return {
        "documents": len(lengths),
        "cpu_seconds": round(cpu, 3),
        "ns_per_document": round(cpu / len(lengths) * 1e9, 2),
    }


def run_child(path: str, window_docs: int | None, mode: str = "--child") -> dict:
    cmd = [sys.executable, __file__, mode, path, "--window-docs", str(window_docs or 0)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def docs_per_step(lengths: np.ndarray, topo: balancer.Topology) -> float:
    return topo.tokens_per_step * len(lengths) / float(lengths.sum())


def windowed_efficiency(lengths, topo, window_docs: int, seed: int) -> tuple[float, int]:
    """Epoch efficiency of the epoch planned window by window (the window plans concatenated), and the windows."""
    k = num_windows(len(lengths), window_docs)
    plans = [
        plan_window(lengths, topo, DEFAULT_COST, seed=seed, epoch=0, index=i, window_docs=window_docs) for i in range(k)
    ]
    ptr = [np.zeros(1, dtype=np.int64)]
    for p in plans:
        ptr.append(p.mb_ptr[1:] + ptr[-1][-1])
    whole = balancer.Plan(
        lengths, topo, DEFAULT_COST,
        np.concatenate([p.doc for p in plans]), np.concatenate([p.start for p in plans]),
        np.concatenate([p.end for p in plans]), np.concatenate(ptr),
    )  # fmt: skip
    return float(whole.metrics()["epoch_efficiency"]), k


def quality(traces: list[str], seed: int, scaled: bool = False) -> list[dict]:
    """The planner-quality rows; `scaled`: each trace resampled to SCALED_STEPS steps' documents (at most 8x its
    documents) for its first topology, so that windows of up to 128 steps cut its epochs into several (traces that
    have that many steps already are left out)."""
    rows = []
    for trace in traces:
        lengths = load_trace(trace, seed=seed)
        if scaled:
            steps = lengths.sum() / standard_topology(lengths, *next(iter(TOPOLOGIES.values()))).tokens_per_step
            if steps >= SCALED_STEPS:
                continue
            scale = min(8, int(np.ceil(SCALED_STEPS / steps)))
            lengths = np.random.default_rng(seed).choice(lengths, scale * len(lengths))
        for tname, (dp, cp, pp, m) in TOPOLOGIES.items():
            topo = standard_topology(lengths, dp, cp, pp, m)
            base = float(balancer.plan(lengths, topo, DEFAULT_COST, seed=seed).metrics()["epoch_efficiency"])
            per = docs_per_step(lengths, topo)
            row = {"distribution": trace, "topology": tname, "documents": len(lengths), "whole_epoch": base}
            row["docs_per_step"] = round(per, 1)
            for steps in STEPS:
                eff, k = windowed_efficiency(lengths, topo, max(topo.bins_per_step, int(np.ceil(steps * per))), seed)
                row[f"steps_{steps}"] = {"efficiency": eff, "loss": base - eff, "windows": k}
            w = default_window_docs(len(lengths), int(lengths.sum()), topo)
            eff, k = windowed_efficiency(lengths, topo, w, seed)
            row["default"] = {"window_docs": w, "efficiency": eff, "loss": base - eff, "windows": k}
            rows.append(row)
            losses = {s: round(row[f"steps_{s}"]["loss"], 4) for s in STEPS}
            print(trace, tname, len(lengths), f"whole {base:.4f}", losses, f"default {row['default']['loss']:.4f}",
                  f"({k} windows)", flush=True)  # fmt: skip
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["window_steps"] for r in result["first_micro_batch"]["windows"]]
    mem = [r["peak_rss_above_lengths_mib"] for r in result["first_micro_batch"]["windows"]]
    rows = result["quality_scaled"]
    loss = [max(row[f"steps_{s}"]["loss"] for row in rows) for s in steps]
    mean = [float(np.mean([row[f"steps_{s}"]["loss"] for row in rows])) for s in steps]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(mem, loss, "o-", label="worst row")
    ax.plot(mem, mean, "s--", label="mean over rows")
    for x, y, s in zip(mem, loss, steps):
        ax.annotate(f"{s} steps", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(0.005, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("peak RSS above the lengths to the first micro-batch, MiB (30M docs)")
    ax.set_ylabel("epoch efficiency lost to windows")
    ax.set_title("window size: quality (resampled planner-quality rows) vs memory", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=30_000_000)
    ap.add_argument("--traces", nargs="+", default=["wlbllm", "prolong", "sft", "heavy"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--whole-epoch", action="store_true", help="also time the whole-epoch plan (minutes)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from the last results JSON, measure nothing")
    ap.add_argument("--child-scan", help=argparse.SUPPRESS)
    ap.add_argument("--window-docs", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.window_docs or None)))
        return
    if args.child_scan:
        print(json.dumps(child_scan(args.child_scan)))
        return
    if args.replot:
        plot(json.loads((RESULTS / "window_planning.json").read_text()), RESULTS / "window_planning.png")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lengths.npy")
        lengths = load_trace("wlbllm", n=args.docs, seed=args.seed)
        np.save(path, lengths.astype(np.int64))
        per = docs_per_step(lengths, balancer.Topology(**BIG))
        del lengths
        first = {"documents": args.docs, "topology": BIG, "docs_per_step": round(per, 1), "windows": []}
        for steps in STEPS:
            r = run_child(path, int(np.ceil(steps * per)))
            first["windows"].append({"window_steps": steps, **r})
            print("first micro-batch", steps, "steps:", r, flush=True)
        first["scan"] = run_child(path, None, "--child-scan")
        print("lengths scan:", first["scan"], flush=True)
        first["default"] = run_child(path, None)
        print("first micro-batch, default:", first["default"], flush=True)
        if args.whole_epoch:
            first["whole_epoch"] = run_child(path, args.docs)
            print("first micro-batch, whole epoch:", first["whole_epoch"], flush=True)
    result = {"first_micro_batch": first, "quality": quality(args.traces, args.seed)}
    result["quality_scaled"] = quality(args.traces, args.seed, scaled=True)
    result["default_window_steps"] = DEFAULT_WINDOW_STEPS
    result["goals"] = {
        "first_micro_batch_cpu<=3s": first["default"]["cpu_seconds"] <= 3.0,
        "memory_above_lengths<=1GiB": first["default"]["peak_rss_above_lengths_mib"] <= 1024,
        "default_loss<=0.005_every_row": all(r["default"]["loss"] <= 0.005 for r in result["quality"]),
        "default_loss<=0.005_every_scaled_row": all(r["default"]["loss"] <= 0.005 for r in result["quality_scaled"]),
    }
    plot(result, RESULTS / "window_planning.png")
    print("goals:", result["goals"])
    print("wrote", write_result("window_planning", result, clock="process_cpu"))


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_window_first_batch() -> str:
    data = tb.load("window_planning")
    first = data["first_micro_batch"]
    runs = [(f"{r['window_steps']} steps", r) for r in first["windows"]] + [("default", first["default"])]
    if "whole_epoch" in first:
        runs.append(("whole epoch (one window)", first["whole_epoch"]))
    rows = [
        [name, f"{r['window_docs']:,}", f"{r['windows']:,}", f"{r['cpu_seconds']:.2f} s",
         f"{r['peak_rss_above_lengths_mib']:,.0f} MiB"]
        for name, r in runs
    ]  # fmt: skip
    table = tb.markdown(
        ["window", "documents per window", "windows", "CPU to first micro-batch", "peak RSS above lengths"], rows
    )
    scan = first["scan"]
    return (
        f"{table}\n\n{first['documents']:,} documents ({first['default']['lengths_mib']:,.0f} MiB of int64 "
        f"lengths, memory-mapped); the pass over the lengths every sampler makes took {scan['cpu_seconds']:.2f} s "
        f"({scan['ns_per_document']:.1f} ns per document). Measured in a fresh process per row: "
        f"{tb.machine_line(data)}; {tb.commit_note(data)}."
    )


def table_window_quality(key: str = "quality") -> str:
    data = tb.load("window_planning")
    if key not in data:
        return "(not measured in the last run of benchmarks/window_planning.py)"
    steps = [r["window_steps"] for r in data["first_micro_batch"]["windows"]]
    rows = []
    for row in data[key]:
        d = row["default"]
        rows.append(
            [row["distribution"], row["topology"], f"{row['documents']:,}", tb.fmt(row["whole_epoch"], ".4f")]
            + [tb.fmt(row[f"steps_{s}"]["loss"], "+.4f") for s in steps]
            + [f"{d['windows']} x {d['window_docs']:,}", tb.fmt(d["loss"], "+.4f")]
        )
    header = ["distribution", "topology", "documents", "whole-epoch efficiency"] + [f"loss, {s} steps" for s in steps]
    return (
        tb.markdown(header + ["default windows", "loss, default"], rows) + f"\n\nGoals: {tb.goals_cell(data['goals'])}."
    )


def table_window_billion() -> str:
    data = tb.load("window_planning")
    first = data["first_micro_batch"]
    d, scan = first["default"], first["scan"]
    plan_cpu = max(0.0, d["cpu_seconds"] - scan["cpu_seconds"])
    n = 1_000_000_000
    mem = f"{d['peak_rss_above_lengths_mib']:,.0f} MiB peak"
    pages = f"{n * 8 / 2**30:.1f} / {n * 4 / 2**30:.1f} GiB file pages"
    rows = [
        ["pass over the lengths (check, sum, fingerprint)", f"{scan['ns_per_document']:.1f} s", "one 8 MiB chunk"],
        ["plan the first window (same window size as at 30M)", f"{plan_cpu:.1f} s", mem],
        ["lengths (int64 / int32 .npy, memory-mapped, shared page cache)", "-", pages],
        ["step count per window (for len and positions)", "-", f"{n // d['window_docs'] + 1:,} ints"],
    ]  # fmt: skip
    total = scan["ns_per_document"] * n / 1e9 + plan_cpu
    return tb.markdown(["per rank, 1B documents", "CPU", "memory"], rows) + (
        f"\n\nAbout {total:.0f} s of CPU before the first micro-batch, scaled from the 30M measurement above "
        "(the pass over the lengths grows with the corpus, the window's plan does not)."
    )


TABLES = {  # docs/ marker name -> the table, from the record
    "window_first_batch": table_window_first_batch,
    "window_quality": table_window_quality,
    "window_quality_scaled": lambda: table_window_quality("quality_scaled"),
    "window_billion": table_window_billion,
}


if __name__ == "__main__":
    main()
