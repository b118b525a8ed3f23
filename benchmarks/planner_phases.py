"""Where does the planner's time go on a 1M-document epoch? Process CPU time of each pass of `balancer.plan`.

The two epochs of benchmarks/planner_speed.py: 1M WLB-LLM documents on dp64 x cp4 x M8 x 32,768 (few large steps)
and 1M SFT-like documents (log-normal, median 700 tokens) on dp4 x cp2 x M4 x 2,048 (~17K small steps). Each pass
the planner calls through its module's names is timed by a wrapper (process CPU, summed over `--repeat` plans after
one warm-up plan): the batched packing of the light steps (`pack_light_steps`) and its grading (`steps_to_repack`),
settling the steps in order (`settle`: `pack_step` where the batched packing is not kept), the quality passes
after it (replica refinement `refine_packed`, moves across steps `move_across`, the replicas' permutation
`permute_replicas`); "the rest" is the plan's total minus these (shuffling and cutting into steps, assembling the
Plan). Each pass's share is a ratio in one run, so the machine's load moves it less than the seconds. A third
epoch, 50K SFT-like documents on the same small steps, is one where the moves across steps run (epochs of at most
50K units). What each quality pass buys: every epoch is planned again with that pass left out (the pass replaced by
the identity), its epoch efficiency beside the full plan's and the CPU time it saved.
Writes benchmarks/results/planner_phases.json and prints the tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import _render as tb
from _common import DEFAULT_COST, table, write_result
from planner_speed import FEW_STEPS, sft_like

import balancer
import balancer.planning.planner as planner
from balancer.data.traces import load_trace

PASSES = ("pack_light_steps", "steps_to_repack", "settle", "refine_packed", "move_across", "permute_replicas")
COLUMNS = ["epoch", "plan (CPU)", *PASSES, "the rest"]


def timed_passes(lengths, topology, repeat: int) -> dict:
    """Mean CPU seconds of the whole plan and of each pass over `repeat` plans (the wrappers removed after)."""
    spent: dict[str, float] = defaultdict(float)
    saved = {name: getattr(planner, name) for name in PASSES}

    def wrap(name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.process_time()
            out = fn(*args, **kwargs)
            spent[name] += time.process_time() - t0
            return out

        return timed

    try:
        for name, fn in saved.items():
            setattr(planner, name, wrap(name, fn))
        balancer.plan(lengths, topology, DEFAULT_COST, seed=0)  # warm-up
        spent.clear()
        for _ in range(repeat):
            t0 = time.process_time()
            balancer.plan(lengths, topology, DEFAULT_COST, seed=0)
            spent["total"] += time.process_time() - t0
    finally:
        for name, fn in saved.items():
            setattr(planner, name, fn)
    out = {name: spent[name] / repeat for name in ("total", *PASSES)}
    plan = balancer.plan(lengths, topology, DEFAULT_COST, seed=0)
    out["epoch_efficiency"] = float(plan.metrics()["epoch_efficiency"])
    out["rest"] = out["total"] - sum(out[name] for name in PASSES)
    return out


QUALITY_PASSES = ("refine_packed", "move_across")  # the permutation moves no document between replicas' times
ABLATION_COLUMNS = ["epoch", "pass left out", "plan (CPU)", "epoch efficiency", "with the pass", "CPU with the pass"]


def without(lengths, topology, name: str) -> tuple[float, float]:
    """(CPU seconds, epoch efficiency) of one plan with the quality pass `name` replaced by the identity."""
    saved = getattr(planner, name)
    setattr(planner, name, lambda packed, *args, **kwargs: packed)
    try:
        t0 = time.process_time()
        plan = balancer.plan(lengths, topology, DEFAULT_COST, seed=0)
        return time.process_time() - t0, float(plan.metrics()["epoch_efficiency"])
    finally:
        setattr(planner, name, saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--documents", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    epochs = {
        "WLB-LLM, dp64 x cp4 x M8 x 32,768": (load_trace("wlbllm", n=args.documents, seed=1), FEW_STEPS),
        "SFT-like, dp4 x cp2 x M4 x 2,048": (
            sft_like(args.documents),
            balancer.Topology(dp=4, cp=2, micro_batches=4, max_tokens=2048),
        ),
        "SFT-like 50K, dp4 x cp2 x M4 x 2,048": (
            sft_like(50_000),
            balancer.Topology(dp=4, cp=2, micro_batches=4, max_tokens=2048),
        ),
    }
    rows, out, ablation = [], {}, []
    for name, (lengths, topology) in epochs.items():
        out[name] = timed_passes(lengths, topology, args.repeat)
        rows.append(cells(name, out[name]))
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
        for left_out in QUALITY_PASSES:
            if out[name][left_out] > 0.005 * out[name]["total"]:  # passes that ran (the rest return at once)
                cpu, efficiency = without(lengths, topology, left_out)
                ablation.append({"epoch": name, "left_out": left_out, "cpu_s": cpu, "epoch_efficiency": efficiency})
                ablation[-1] |= {"full_efficiency": out[name]["epoch_efficiency"], "full_cpu_s": out[name]["total"]}
                print(ablation[-1], flush=True)
    payload = {"documents": args.documents, "repeat": args.repeat, "epochs": out, "ablation": ablation}
    payload["tables"] = {"phases": table(COLUMNS, rows), "ablation": table(ABLATION_COLUMNS, ablation_rows(ablation))}
    path = write_result("planner_phases", payload, clock="process_cpu")
    print(f"wrote {path}", file=sys.stderr)


def cells(name: str, spent: dict) -> list[str]:
    total = spent["total"]
    return [name, f"{total:.3f} s"] + [f"{spent[k]:.3f} s ({spent[k] / total:.0%})" for k in (*PASSES, "rest")]


def ablation_rows(ablation: list[dict]) -> list[list[str]]:
    return [
        [a["epoch"], a["left_out"], f"{a['cpu_s']:.3f} s", f"{a['epoch_efficiency']:.6f}"]
        + [f"{a['full_efficiency']:.6f}", f"{a['full_cpu_s']:.3f} s"]
        for a in ablation
    ]


def table_planner_phases() -> str:
    data = tb.load("planner_phases")
    rows = [cells(name, spent) for name, spent in data["epochs"].items()]
    head = f"Mean of {data['repeat']} plans, process CPU (share of the plan):\n\n"
    out = head + tb.markdown(COLUMNS, rows)
    out += "\n\nEach quality pass left out (one plan each; the full plan's figures beside it):\n\n"
    return out + tb.markdown(ABLATION_COLUMNS, ablation_rows(data["ablation"])) + tb.record_line(data)


TABLES = {"planner_phases": table_planner_phases}  # docs/ marker name -> the table, from the record


if __name__ == "__main__":
    main()
