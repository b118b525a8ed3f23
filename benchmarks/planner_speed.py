"""How fast is the planner, on few large steps and on many small ones, against simple greedies?

Two questions, each answered side by side in one run (process CPU time, best of `--repeat`; the machine is
shared, so the load average is recorded at start and end):

1. *Few large steps* (the original row): dp64 x cp4, 8 micro-batches, max_tokens 32768, lengths resampled from the
   built-in WLB-LLM trace, 100K and 1M documents, against the WLB-LLM style greedy (benchmarks/wlb.py).
2. *Many small steps*: 1M SFT-like documents (log-normal, median 700 tokens, sigma 0.8, clipped to 32..4,096) on
   dp4 x cp2 x M4 x 2,048 (~17K steps) against (a) the same documents on dp64 x cp4 x M8 x 32,768 (~20 steps) and
   (b) a per-document cost greedy (each document, in shuffled order, to the least-loaded micro-batch with room;
   steps cut every tokens_per_step tokens). Goals: <= 0.08x the greedy, <= 3x the few-steps topology.

3. *The built-in SFT trace* (100K documents, about 2,150 tokens each) on dp4 x cp2 (M4) and dp4 x cp2 x pp4 (M8),
   2,048 tokens per rank, the llama3-8b FLOPs cost model: what `balancer plan sft --dp 4 --cp 2 --model
   llama3-8b` plans (about 1.6 documents per micro-batch, where the batched packing needs its local search and
   pipelines still need `pack_step` on most steps).

Also one step: `pack_step` on ~58 SFT-like documents (dp4 x cp2 x M4, what a sampler or a fixed-batch trainer
calls), and `pack_step` and `balancer.plan` on one global batch of 1,927 WLB-LLM documents (dp8, M4); comparisons
with an earlier commit are benchmarks/plan_guard.py's (`--against REF`).
Writes benchmarks/results/planner_speed.json and prints the tables.
"""

from __future__ import annotations

import argparse
import sys
import time

import _render as tb
import numpy as np
from _common import DEFAULT_COST, write_result
from wlb import wlb_plan

import balancer
from balancer.data.traces import load_trace
from balancer.planning.packing import pack_step

FEW_STEPS = balancer.Topology(dp=64, cp=4, micro_batches=8, max_tokens=32768)  # tokens_per_step: 0.85 x capacity


def cpu_time(fn, repeat: int) -> float:
    """Best process CPU time of `repeat` calls."""
    best = np.inf
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def sft_like(n: int, seed: int = 1) -> np.ndarray:
    """Log-normal SFT lengths: median 700 tokens, sigma 0.8, clipped to 32..4,096."""
    return np.clip(np.random.default_rng(seed).lognormal(np.log(700), 0.8, n), 32, 4096).astype(np.int64)


def cost_greedy(lengths: np.ndarray, topo: balancer.Topology, cost: balancer.CostModel, seed: int = 0) -> float:
    """The per-document baseline: documents in shuffled order, each to the least-loaded micro-batch (by cost) of the
    current step that has room; a step closes when its tokens reach tokens_per_step or a document fits nowhere.
    Returns the sum of step times (section-3 model), so the baseline's result is used and checked."""
    nb, cap = topo.bins_per_step, topo.micro_batch_tokens
    order = np.random.default_rng(seed).permutation(len(lengths))
    tokens, costs = lengths[order].tolist(), cost.cost(lengths[order]).tolist()
    load, used = np.zeros(nb), np.zeros(nb)
    total, step_tokens = 0.0, 0
    for t, c in zip(tokens, costs):
        room = used + t <= cap
        if step_tokens + t > topo.tokens_per_step or not room.any():
            total += float(load.reshape(topo.dp, -1).sum(axis=1).max())
            load[:], used[:], step_tokens = 0.0, 0.0, 0
            room = used + t <= cap
        j = int(np.argmin(np.where(room, load, np.inf)))
        load[j] += c
        used[j] += t
        step_tokens += t
    return total + float(load.reshape(topo.dp, -1).sum(axis=1).max())


def few_large_steps(sizes: list[int], repeat: int) -> list[dict]:
    topo = FEW_STEPS
    rows = []
    for n in sizes:
        lengths = load_trace("wlbllm", n=n, seed=1)
        ours = cpu_time(lambda: balancer.plan(lengths, topo, DEFAULT_COST, seed=0), repeat)
        wlb = cpu_time(lambda: wlb_plan(lengths, topo, DEFAULT_COST, seed=0), 1 if n > 200_000 else repeat)
        m = balancer.plan(lengths, topo, DEFAULT_COST, seed=0).metrics()
        rows.append(
            {"documents": n, "balancer_s": ours, "wlb_s": wlb, "speedup": wlb / ours, "steps": m["steps"]}
            | {"imbalance": m["imbalance"], "epoch_efficiency": m["epoch_efficiency"]}
        )
        print(f"| {n:,} | {ours:.3f} s | {wlb:.3f} s | {wlb / ours:.1f}x | {m['steps']} | {m['imbalance']:.4f} |")
    return rows


def many_small_steps(n: int, repeat: int) -> dict:
    lengths = sft_like(n)
    small = balancer.Topology(dp=4, cp=2, micro_batches=4, max_tokens=2048)
    large = FEW_STEPS
    out = {"documents": n, "lengths": "log-normal median 700, sigma 0.8, clipped 32..4096, seed 1"}
    for name, topo in (("dp4xcp2xM4x2048", small), ("dp64xcp4xM8x32768", large)):
        seconds = cpu_time(lambda: balancer.plan(lengths, topo, DEFAULT_COST, seed=0), repeat)
        m = balancer.plan(lengths, topo, DEFAULT_COST, seed=0).metrics()
        out[name] = {"topology": topo.to_dict(), "cpu_s": seconds, "steps": m["steps"]} | {
            k: m[k] for k in ("imbalance", "epoch_efficiency", "worst_step")
        }
    t0 = time.process_time()
    greedy_total = cost_greedy(lengths, small, DEFAULT_COST)
    out["greedy_cpu_s"] = time.process_time() - t0
    bound = balancer.plan(lengths, small, DEFAULT_COST, seed=0).metrics()["lower_bound_epoch"]  # plan-independent
    out["greedy_epoch_efficiency"] = bound / (greedy_total / small.cp)
    ours = out["dp4xcp2xM4x2048"]["cpu_s"]
    out["vs_greedy"] = ours / out["greedy_cpu_s"]
    out["vs_few_steps"] = ours / out["dp64xcp4xM8x32768"]["cpu_s"]
    out["goals"] = {"<=0.08x_greedy": out["vs_greedy"] <= 0.08, "<=3x_few_steps": out["vs_few_steps"] <= 3}
    return out


def trace_rows(repeat: int) -> list[dict]:
    from balancer.cli.options import MODELS

    lengths = load_trace("sft")
    cost = balancer.CostModel.from_model(**MODELS["llama3-8b"])
    rows = []
    for name, topo in (
        ("dp4 x cp2 x M4 x 2,048", balancer.Topology(dp=4, cp=2, micro_batches=4, max_tokens=2048)),
        ("dp4 x cp2 x pp4 x M8 x 2,048", balancer.Topology(dp=4, cp=2, pp=4, micro_batches=8, max_tokens=2048)),
    ):
        seconds = cpu_time(lambda: balancer.plan(lengths, topo, cost, seed=0), repeat)
        m = balancer.plan(lengths, topo, cost, seed=0).metrics()
        rows.append({"topology": name, "documents": len(lengths), "cpu_s": seconds, "steps": m["steps"]})
        rows[-1] |= {k: m[k] for k in ("imbalance", "epoch_efficiency")}
        print(f"sft trace, {name}: {seconds:.2f} s, {m['steps']} steps, efficiency {m['epoch_efficiency']:.4f}")
    return rows


def one_step_rows() -> list[dict]:
    """One step's planning, as a sampler or a fixed-batch trainer does it: `pack_step` on ~58 SFT-like documents,
    and `pack_step` and `balancer.plan` on one global batch of 1,927 WLB-LLM documents (0.85 of dp8 x M4 x 262,144,
    the plan_guard.py shape). Mean of 20 calls, best of 5, process CPU."""
    step = balancer.Topology(dp=4, cp=2, micro_batches=4, max_tokens=2048)
    batch_topo = balancer.Topology(dp=8, micro_batches=4, max_tokens=262144)
    batch = load_trace("wlbllm", n=2000, seed=2)
    batch = batch[: int(np.sum(np.cumsum(batch) <= 0.85 * batch_topo.capacity))]
    docs = sft_like(58, seed=3)
    cases = [
        (f"pack_step, {len(docs)} SFT-like documents, dp4 x cp2 x M4 x 2048", docs, step, "pack_step"),
        (f"pack_step, {len(batch):,} WLB-LLM documents, dp8 x M4 x 262144", batch, batch_topo, "pack_step"),
        (f"balancer.plan, {len(batch):,} WLB-LLM documents, dp8 x M4 x 262144", batch, batch_topo, "plan"),
    ]
    rows = []
    for name, lengths, topo, kind in cases:
        c = DEFAULT_COST.cost(lengths)
        if kind == "pack_step":
            call = lambda: pack_step(c, lengths, topo)  # noqa: E731
        else:
            call = lambda: balancer.plan(lengths, topo, DEFAULT_COST, seed=0)  # noqa: E731
        number = 20
        ms = cpu_time(lambda: [call() for _ in range(number)], 5) / number * 1e3
        rows.append({"case": name, "documents": int(len(lengths)), "ms": ms})
        print(f"{name}: {ms:.2f} ms")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--sft-documents", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = few_large_steps(args.sizes, args.repeat)
    growth = rows[-1]["balancer_s"] / rows[0]["balancer_s"] if len(rows) > 1 else None
    size_ratio = rows[-1]["documents"] / rows[0]["documents"] if len(rows) > 1 else None
    many = many_small_steps(args.sft_documents, args.repeat)
    print({k: v for k, v in many.items() if not isinstance(v, dict)})
    traces = trace_rows(args.repeat)
    steps = one_step_rows()
    path = write_result(
        "planner_speed",
        {
            "topology": FEW_STEPS.to_dict(),
            "rows": rows,
            "growth": growth,
            "size_ratio": size_ratio,
            "many_small_steps": many,
            "sft_trace": traces,
            "one_step": steps,
        },
        clock="process_cpu",
    )
    print(f"wrote {path}", file=sys.stderr)


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_planner_speed() -> str:
    data = tb.load("planner_speed")
    clock = "process CPU" if data.get("clock") == "process_cpu" else data.get("clock", "wall")
    load_avg = data.get("machine", {})
    rows = [
        [
            f"{r['documents']:,}",
            f"{r['balancer_s']:.3f} s",
            f"{r['wlb_s']:.3f} s",
            f"{r['speedup']:.1f}x",
            f"{r['balancer_s'] / r['wlb_s']:.3f}x",
            str(r["steps"]),
        ]
        for r in data["rows"]
    ]
    table = tb.markdown(["documents", "balancer", "WLB-style greedy", "speedup", "balancer / greedy", "steps"], rows)
    out = f"dp64 x cp4 x M8 x 32,768, WLB-LLM lengths, {clock} time (best of 3):\n\n{table}"
    out += f"\n\nTime grows {data['growth']:.1f}x for {data['size_ratio']:.0f}x the documents."
    many = data.get("many_small_steps")
    if many:
        small, large = many["dp4xcp2xM4x2048"], many["dp64xcp4xM8x32768"]
        rows = [
            [
                "dp4 x cp2 x M4 x 2,048",
                str(small["steps"]),
                f"{small['cpu_s']:.2f} s",
                tb.fmt(small["epoch_efficiency"], ".4f"),
            ],
            [
                "dp64 x cp4 x M8 x 32,768",
                str(large["steps"]),
                f"{large['cpu_s']:.2f} s",
                tb.fmt(large["epoch_efficiency"], ".4f"),
            ],
            [
                "dp4 x cp2 x M4 x 2,048, per-document cost greedy",
                "",
                f"{many['greedy_cpu_s']:.2f} s",
                tb.fmt(many["greedy_epoch_efficiency"], ".4f"),
            ],
        ]
        out += (
            f"\n\n{many['documents']:,} SFT-like documents ({many['lengths']}), {clock} time:\n\n"
            + tb.markdown(["topology", "steps", "plan time", "epoch efficiency"], rows)
            + f"\n\nMany small steps take {many['vs_greedy']:.3f}x the greedy's time (goal <= 0.08x) and "
            f"{many['vs_few_steps']:.2f}x the few-steps topology's (goal <= 3x): {tb.goals_cell(many['goals'])}."
        )
    if data.get("sft_trace"):
        rows = [
            [r["topology"], str(r["steps"]), f"{r['cpu_s']:.2f} s", tb.fmt(r["epoch_efficiency"], ".4f")]
            for r in data["sft_trace"]
        ]
        out += (
            f"\n\nThe built-in `sft` trace ({data['sft_trace'][0]['documents']:,} documents), llama3-8b cost, "
            f"{clock} time:\n\n" + tb.markdown(["topology", "steps", "plan time", "epoch efficiency"], rows)
        )
    if data.get("one_step"):
        rows = [[r["case"], f"{r['ms']:.2f} ms"] for r in data["one_step"]]
        out += "\n\nOne step (mean of 20 calls, best of 5):\n\n" + tb.markdown(["call", "time"], rows)
    if load_avg.get("load_average_start"):
        out += (
            f"\n\nMachine: {tb.cores(load_avg)}, {tb.commit_note(data)}, load average (1/5/15 min) "
            f"{load_avg['load_average_start']} at start, {load_avg['load_average_end']} at end."
        )
    return out


TABLES = {  # docs/ marker name -> the table, from the record
    "planner_speed": table_planner_speed,
}


if __name__ == "__main__":
    main()
