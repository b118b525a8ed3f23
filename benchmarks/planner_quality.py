"""How close to the lower bound does the planner get, against a WLB-LLM style cost-greedy, on every trace?

Issue 2's setting: max_tokens = next power of two >= longest document / cp, tokens_per_step = 0.85 x capacity,
cost attention 2/53000 per causal pair + 1 per token; topologies dp8 (M4), dp4 x cp8 (M8), dp4 x cp2 x pp4 (M8);
distributions: the two published traces, a near-uniform SFT mix and a generated heavy tail to 1M tokens.
With `--before FILE` (a results file of an earlier version, e.g. the run on the planner before its batched packing:
`git show 6db6159:benchmarks/results/planner_quality_before.json > before.json`; results/ keeps only the current
record, earlier ones live in git) every row also carries that version's metrics and the goal
"efficiency_within_0.003_of_before". Writes benchmarks/results/planner_quality.json and prints the README table.
"""

from __future__ import annotations

import argparse
import json

import _render as tb
from _common import DEFAULT_COST, TOPOLOGIES, standard_topology, write_result
from wlb import wlb_plan

import balancer
from balancer.data.traces import load_trace

KEYS = ("imbalance", "epoch_efficiency", "worst_step", "mean_delay_steps", "plan_seconds", "steps")


def goal(name: str, pp: int, ours: dict, wlb: dict) -> dict:
    out = {
        "no_worse_than_wlb": ours["imbalance"] <= wlb["imbalance"] + 1e-9
        and ours["epoch_efficiency"] >= wlb["epoch_efficiency"] - 1e-9
    }
    if pp == 1:
        out["imbalance<=1.02"] = ours["imbalance"] <= 1.02
        out["efficiency>=0.95"] = ours["epoch_efficiency"] >= 0.95
    else:
        out["excess<=0.7*wlb"] = (ours["imbalance"] - 1) <= 0.7 * (wlb["imbalance"] - 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", nargs="+", default=["wlbllm", "prolong", "sft", "heavy"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--before", help="an earlier results file whose balancer rows are compared (same traces)")
    args = ap.parse_args()
    before = {}
    if args.before:
        saved = json.loads(open(args.before).read())
        before = {(r["distribution"], r["topology"]): r["balancer"] for r in saved["rows"]}
    rows = []
    print(
        "| distribution | topology | balancer imbalance | WLB imbalance | balancer efficiency | WLB efficiency "
        "| balancer worst step | WLB worst step | balancer delay (steps) | goals |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for trace in args.traces:
        lengths = load_trace(trace, seed=args.seed)
        for tname, (dp, cp, pp, m) in TOPOLOGIES.items():
            topo = standard_topology(lengths, dp, cp, pp, m)
            ours = balancer.plan(lengths, topo, DEFAULT_COST, seed=args.seed)
            ours.validate()
            wlb = wlb_plan(lengths, topo, DEFAULT_COST, seed=args.seed)
            mo, mw = ours.metrics(), wlb.metrics()
            g = goal(trace, pp, mo, mw)
            earlier = before.get((trace, tname))
            if earlier is not None:
                g["efficiency_within_0.003_of_before"] = mo["epoch_efficiency"] >= earlier["epoch_efficiency"] - 0.003
            rows.append(
                {
                    "distribution": trace,
                    "topology": tname,
                    "max_tokens": topo.max_tokens,
                    "tokens_per_step": topo.tokens_per_step,
                    "documents": int(len(lengths)),
                    "balancer": {k: mo[k] for k in KEYS},
                    "wlb": {k: mw[k] for k in KEYS},
                    "goals": g,
                }
                | ({"before": {k: earlier[k] for k in KEYS}} if earlier is not None else {})
            )
            status = "all met" if all(g.values()) else "missed: " + ", ".join(k for k, v in g.items() if not v)
            print(
                f"| {trace} | {tname} | {mo['imbalance']:.4f} | {mw['imbalance']:.4f} | "
                f"{mo['epoch_efficiency']:.4f} | {mw['epoch_efficiency']:.4f} | {mo['worst_step']:.3f} | "
                f"{mw['worst_step']:.3f} | {mo['mean_delay_steps']:.2f} | {status} |",
                flush=True,
            )
    payload = {"cost": DEFAULT_COST.to_dict(), "rows": rows}
    if args.before:
        payload["before"] = {"file": args.before, "command": saved.get("command"), "date": saved.get("date")}
    path = write_result("planner_quality", payload, clock="wall")
    print(f"\nwrote {path}")


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_planner_quality() -> str:
    data = tb.load("planner_quality")
    rows = []
    for row in data["rows"]:
        ours, wlb = row["balancer"], row["wlb"]
        rows.append(
            [
                row["distribution"],
                row["topology"],
                tb.fmt(ours["imbalance"], ".4f"),
                tb.fmt(wlb["imbalance"], ".4f"),
                tb.fmt(ours["epoch_efficiency"], ".4f"),
                tb.fmt(wlb["epoch_efficiency"], ".4f"),
                tb.fmt(ours["worst_step"]),
                tb.fmt(wlb["worst_step"]),
                tb.fmt(ours["mean_delay_steps"], ".2f"),
                tb.fmt(row["before"]["epoch_efficiency"], ".4f") if "before" in row else "",
                "all met"
                if all(row["goals"].values())
                else "missed: " + ", ".join(k for k, v in row["goals"].items() if not v),
            ]
        )
    header = [
        "distribution",
        "topology",
        "imbalance",
        "WLB imbalance",
        "epoch efficiency",
        "WLB efficiency",
        "worst step",
        "WLB worst step",
        "delay (steps)",
        "efficiency before",
        "goals",
    ]
    if not any("before" in row for row in data["rows"]):  # run without --before: no such column
        header.pop(-2)
        rows = [row[:-2] + row[-1:] for row in rows]
    return tb.markdown(header, rows)


TABLES = {  # docs/ marker name -> the table, from the record
    "planner_quality": table_planner_quality,
}


if __name__ == "__main__":
    main()
