"""How fast is the planner, against the WLB-LLM style greedy, as the epoch grows?

dp64 x cp4, 8 micro-batches, max_tokens 32768 (a micro-batch holds 131,072 tokens), lengths resampled from the
built-in WLB-LLM trace (max 124,913). Times one full epoch plan at 100K and 1M documents for both planners in the
same run (best of `--repeat`), the growth 1M / 100K, and `pack_step` on one global batch of ~2,000 documents.
Writes benchmarks/results/planner_speed.json and prints the README table.
"""

from __future__ import annotations

import argparse
import time
import timeit

import numpy as np
from _common import DEFAULT_COST, write_result
from wlb import wlb_plan

import balancer
from balancer.data.traces import load_trace


def best_time(fn, repeat: int) -> float:
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    topo = balancer.Topology(
        dp=64, cp=4, micro_batches=8, max_tokens=32768, tokens_per_step=int(0.85 * 64 * 4 * 8 * 32768)
    )
    rows = []
    for n in args.sizes:
        lengths = load_trace("wlbllm", n=n, seed=1)
        ours = best_time(lambda: balancer.plan(lengths, topo, DEFAULT_COST, seed=0), args.repeat)
        wlb = best_time(lambda: wlb_plan(lengths, topo, DEFAULT_COST, seed=0), 1 if n > 200_000 else args.repeat)
        m = balancer.plan(lengths, topo, DEFAULT_COST, seed=0).metrics()
        rows.append(
            {
                "documents": n,
                "balancer_s": ours,
                "wlb_s": wlb,
                "speedup": wlb / ours,
                "steps": m["steps"],
                "imbalance": m["imbalance"],
            }
        )
        print(
            f"| {n:,} | {ours:.3f} s | {wlb:.3f} s | {wlb / ours:.1f}x | {m['steps']} | {m['imbalance']:.4f} |",
            flush=True,
        )
    growth = rows[-1]["balancer_s"] / rows[0]["balancer_s"] if len(rows) > 1 else None
    size_ratio = rows[-1]["documents"] / rows[0]["documents"] if len(rows) > 1 else None
    step_topo = balancer.Topology(dp=8, micro_batches=4, max_tokens=262144)
    batch = load_trace("wlbllm", n=2000, seed=2)
    c = DEFAULT_COST.cost(batch)
    step_ms = min(timeit.repeat(lambda: balancer.pack_step(c, batch, step_topo), number=1, repeat=20)) * 1e3
    print(
        f"\ngrowth {size_ratio:.0f}x documents -> {growth:.1f}x time; one global batch of 2,000 documents "
        f"(dp8, M4): {step_ms:.1f} ms"
    )
    path = write_result(
        "planner_speed",
        {
            "topology": topo.to_dict(),
            "rows": rows,
            "growth": growth,
            "size_ratio": size_ratio,
            "global_batch_2000_ms": step_ms,
        },
        clock="wall",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
