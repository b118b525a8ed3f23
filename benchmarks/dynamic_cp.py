"""Does regrouping the ranks per micro-batch slot (dynamic CP) beat fixed CP groups, judged against its own bound?

For the traces and topologies of planner_quality.py, plus the memory-tight heavy-tail pipeline case (dp4 x cp2 x
pp4, 8 micro-batches, max_tokens the next power of two above half the longest document, steps of half the
capacity, the `heavy` trace: documents up to 1M tokens), plan an epoch with fixed CP groups and with
cp_sizes = every power of two dividing dp*cp, write both plans as JSON, and evaluate each JSON file independently
(this script's own reader and time model, not the package's): the static plan by the 1F1B formula per replica, the
dynamic one by the slot model (a group starts when all its ranks finished their previous slot). Epoch efficiency =
lower bound / sum of step times, the bound `max(W/(dp*cp) * (1+(P-1)/M), P * max_d cost(d) / C)` with C = cp for
the static plan and C = max(cp_sizes) for the dynamic one. Planning time: best CPU seconds of 3 runs, static and
dynamic in the same run (the machine is shared; the load average is recorded). Only the compute cost model is
used unless the package has a communication-aware one (`CostModel.comm_*`), which is then reported as well.

Writes benchmarks/results/dynamic_cp.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import _render as tb
import numpy as np
from _common import DEFAULT_COST, TOPOLOGIES, standard_topology, write_result

import balancer
from balancer.data.traces import load_trace

TIGHT = ("heavy", "dp4xcp2xpp4-tight")


def tight_topology(lengths: np.ndarray) -> balancer.Topology:
    dp, cp, pp, m = 4, 2, 4, 8
    max_tokens = 1 << int(np.floor(np.log2(int(lengths.max()) / 2)) + 1)  # next power of two above half the longest
    return balancer.Topology(
        dp=dp, cp=cp, pp=pp, micro_batches=m, max_tokens=max_tokens, tokens_per_step=dp * cp * m * max_tokens // 2
    )


# ---- independent evaluation of a plan JSON file ----------------------------------------------------------------------
def _doc_cost(data: dict, lengths: np.ndarray, mb: dict) -> list[float]:
    c = data["cost_model"]
    tokens = [int(lengths[d]) for d in mb["docs"]] + [b - a for _, a, b in mb.get("spans", [])]
    t = np.asarray(tokens, dtype=np.float64)
    pairs = t * (t + 1) / 2 if c.get("causal", True) else t * t
    return (c["attn_coef"] * pairs + c["linear_coef"] * t).tolist()


def evaluate(path: Path, lengths: np.ndarray) -> dict:
    """Epoch efficiency of a plan file, from the JSON alone (plus the lengths) and the published time model."""
    data = json.loads(path.read_text())
    topo, fixed = data["topology"], data["cost_model"].get("fixed", 0.0)
    dp, cp, pp, m = topo["dp"], topo["cp"], topo["pp"], topo["micro_batches"]
    sizes = topo.get("cp_sizes")
    largest = max(sizes) if sizes else cp
    total_time, work, heaviest, placed = 0.0, 0.0, 0.0, []
    for step in data["steps"]:
        finish, biggest = np.zeros(dp * cp), np.zeros(dp * cp)
        if sizes:  # slot model: a group starts when all its ranks are done with their previous slot
            for slot in step["slots"]:
                for g in slot["groups"]:
                    start, size = g["ranks"]
                    costs = _doc_cost(data, lengths, g)
                    t = (sum(costs) + fixed) / size
                    begin = finish[start : start + size].max()
                    finish[start : start + size] = begin + t
                    biggest[start : start + size] = np.maximum(biggest[start : start + size], t)
                    work, heaviest = work + sum(costs), max([heaviest, *costs])
                    placed += list(g["docs"])
        else:  # 1F1B per replica
            for r, rep in enumerate(step["replicas"]):
                for mb in rep["micro_batches"]:
                    costs = _doc_cost(data, lengths, mb)
                    t = (sum(costs) + fixed) / cp
                    finish[r * cp : (r + 1) * cp] += t
                    biggest[r * cp : (r + 1) * cp] = np.maximum(biggest[r * cp], t)
                    work, heaviest = work + sum(costs), max([heaviest, *costs])
                    placed += list(mb["docs"])
        total_time += float(((pp - 1) * biggest + finish).max())
    groups_per_slot = (dp * cp) // largest
    bound_work = (work + fixed * groups_per_slot * m * len(data["steps"])) / (dp * cp) * (1 + (pp - 1) / m)
    bound = max(bound_work, pp * (heaviest + fixed) / largest)
    assert sorted(placed) == list(range(len(lengths))), f"{path}: not every document exactly once"
    return {"epoch_efficiency": bound / total_time, "steps": len(data["steps"])}


# ---- one row -------------------------------------------------------------------------------------------------------
def _timed_plan(lengths, topo, cost, seed, repeat: int = 3):
    """The plan, and the best CPU and wall seconds of `repeat` runs (the first run of a process pays first-touch
    page faults and warm-up; static and dynamic plans are timed alike)."""
    best_cpu = best_wall = np.inf
    for _ in range(repeat):
        cpu, wall = time.process_time(), time.perf_counter()
        plan = balancer.plan(lengths, topo, cost, seed=seed)
        best_cpu, best_wall = min(best_cpu, time.process_time() - cpu), min(best_wall, time.perf_counter() - wall)
    return plan, best_cpu, best_wall


def row(trace: str, name: str, lengths: np.ndarray, topo: balancer.Topology, cost, seed: int, tmp: Path) -> dict:
    pool = topo.dp * topo.cp
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= pool and pool % s == 0)
    dyn_topo = dataclasses.replace(topo, cp_sizes=sizes)
    static, static_cpu, static_wall = _timed_plan(lengths, topo, cost, seed)
    dynamic, dyn_cpu, dyn_wall = _timed_plan(lengths, dyn_topo, cost, seed)
    out = {"distribution": trace, "topology": name, "cp_sizes": list(sizes), "max_tokens": topo.max_tokens}
    out["tokens_per_step"] = topo.tokens_per_step
    for label, plan, cpu, wall in (
        ("static", static, static_cpu, static_wall),
        ("dynamic", dynamic, dyn_cpu, dyn_wall),
    ):
        path = tmp / f"{trace}-{name}-{label}.json"
        plan.save(path)
        indep = evaluate(path, lengths)
        mine = plan.metrics()
        assert abs(indep["epoch_efficiency"] - mine["epoch_efficiency"]) < 1e-9, (label, indep, mine)
        out[label] = {
            "epoch_efficiency": indep["epoch_efficiency"],
            "imbalance": mine["imbalance"],
            "worst_step": mine["worst_step"],
            "steps": indep["steps"],
            "plan_cpu_seconds": cpu,
            "plan_wall_seconds": wall,
        }
    if dynamic.dynamic:
        used = np.bincount(dynamic.group_size, weights=dynamic.group_size)  # rank-slots per group size
        out["dynamic"]["rank_slots_by_group_size"] = {str(s): int(used[s]) for s in sizes if s < len(used)}
    out["goals"] = goals(out, tight=(trace, name) == TIGHT)
    return out


# ---- the communication-aware model ---------------------------------------------------------------------------------
def comm_cost() -> balancer.CostModel:
    """Llama-3-8B on H100s over InfiniBand (the package's public-figure preset): compute, per-piece overhead and
    K/V transfer per ring step."""
    return balancer.CostModel.from_model(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        hardware="h100-ib",
    )


def comm_total(plan: balancer.Plan, cost: balancer.CostModel) -> float:
    """Sum of step times with every micro-batch timed by the layout-aware prediction (zigzag, ring) on its group,
    assembled by this script's own 1F1B / slot model."""
    from balancer.planning.cost.predict import micro_batch_time

    t, sizes, total = plan.topology, plan.end - plan.start, 0.0
    group_size = plan.group_size if plan.dynamic else np.full(len(plan.mb_ptr) - 1, t.cp)
    times = np.array(
        [micro_batch_time(cost, sizes[a:b], int(z)) for a, b, z in zip(plan.mb_ptr[:-1], plan.mb_ptr[1:], group_size)]
    )
    if not plan.dynamic:
        per = times.reshape(plan.num_steps, t.dp, t.micro_batches)
        return float(((t.pp - 1) * per.max(axis=2) + per.sum(axis=2)).max(axis=1).sum())
    for s in range(plan.num_steps):
        finish, biggest = np.zeros(t.pool_size), np.zeros(t.pool_size)
        for slot in range(s * t.micro_batches, (s + 1) * t.micro_batches):
            for g in range(plan.slot_ptr[slot], plan.slot_ptr[slot + 1]):
                a, z = plan.group_start[g], plan.group_size[g]
                finish[a : a + z] = finish[a : a + z].max() + times[g]
                biggest[a : a + z] = np.maximum(biggest[a : a + z], times[g])
        total += float(((t.pp - 1) * biggest + finish).max())
    return total


def comm_row(trace: str, name: str, lengths: np.ndarray, topo: balancer.Topology, seed: int) -> dict:
    import attention.layout  # noqa: F401  (the layout-aware prediction's import, paid once per process, not timed)

    cost = comm_cost()
    pool = topo.dp * topo.cp
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= pool and pool % s == 0)
    static, static_cpu, _ = _timed_plan(lengths, topo, cost, seed)
    dynamic, dyn_cpu, _ = _timed_plan(lengths, dataclasses.replace(topo, cp_sizes=sizes), cost, seed)
    ts, td = comm_total(static, cost), comm_total(dynamic, cost)
    used = np.bincount(dynamic.group_size, weights=dynamic.group_size)
    return {
        "goals": {"plan_time<=3x_static": dyn_cpu <= 3 * static_cpu},
        "distribution": trace,
        "topology": name,
        "cp_sizes": list(sizes),
        "static_step_seconds_total": ts,
        "dynamic_step_seconds_total": td,
        "predicted_speedup": ts / td,
        "rank_slots_on_groups_of_1": float(used[1] / used.sum()),
        "plan_cpu_seconds": {"static": static_cpu, "dynamic": dyn_cpu},
    }


def goals(r: dict, tight: bool) -> dict:
    s, d = r["static"]["epoch_efficiency"], r["dynamic"]["epoch_efficiency"]
    g = {}
    if s < 0.95:
        g["removes>=half_of_inefficiency"] = (1 - d) <= 0.5 * (1 - s)
    else:
        g["no_worse_than_static-0.005"] = d >= s - 0.005
    if tight:
        g["efficiency>=0.93"] = d >= 0.93
    g["plan_time<=3x_static"] = r["dynamic"]["plan_cpu_seconds"] <= 3 * r["static"]["plan_cpu_seconds"]
    return g


def table(data: dict) -> str:
    """The markdown table of a results file (docs/dynamic-cp.md shows it)."""
    lines = [
        "| distribution | topology | static efficiency | dynamic efficiency | plan CPU s, static / dynamic | "
        "rank-slots on groups of 1 | goals |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        s, d = r["static"], r["dynamic"]
        slots = d.get("rank_slots_by_group_size", {})
        single = slots.get("1", 0) / max(1, sum(slots.values()))
        missed = [k for k, v in r["goals"].items() if not v]
        lines.append(
            f"| {r['distribution']} | {r['topology']} | {s['epoch_efficiency']:.4f} | {d['epoch_efficiency']:.4f} | "
            f"{s['plan_cpu_seconds']:.2f} / {d['plan_cpu_seconds']:.2f} | {single:.0%} | "
            f"{'missed: ' + ', '.join(missed) if missed else 'all met'} |"
        )
    if data.get("communication_rows"):
        lines += [
            "",
            "| distribution | topology | predicted step time, dynamic vs static | rank-slots on groups of 1 | "
            "plan CPU s, static / dynamic |",
            "|---|---|---|---|---|---|",
        ]
        lines[-2] = lines[-2].rstrip() + " goals |"
        for r in data["communication_rows"]:
            cpu = r["plan_cpu_seconds"]
            missed = [k for k, v in r.get("goals", {}).items() if not v]
            lines.append(
                f"| {r['distribution']} | {r['topology']} | {1 / r['predicted_speedup']:.3f} "
                f"({r['predicted_speedup']:.2f}x faster) | {r['rank_slots_on_groups_of_1']:.0%} | "
                f"{cpu['static']:.2f} / {cpu['dynamic']:.2f} | "
                + ("missed: " + ", ".join(missed) if missed else "all met")
                + " |"
            )
    return "\n".join(lines)


def args_order(trace: str) -> int:
    order = ["wlbllm", "prolong", "sft", "heavy"]
    return order.index(trace) if trace in order else len(order)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", nargs="+", default=["wlbllm", "prolong", "sft", "heavy"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", action="store_true", help="print the table of the saved results and exit")
    ap.add_argument(
        "--comm-traces",
        nargs="*",
        default=["wlbllm", "prolong", "sft", "heavy"],
        help="traces also planned and timed with the communication-aware model (every row by default)",
    )
    ap.add_argument(
        "--comm-only",
        action="store_true",
        help="recompute only the communication rows of --comm-traces in the saved results (other rows kept)",
    )
    ap.add_argument(
        "--comm-max-pool",
        type=int,
        default=64,
        help="communication rows only for pools of at most this many ranks (default: every benchmark row)",
    )
    ap.add_argument(
        "--merge", action="store_true", help="replace only the --traces rows in the saved results (keep the others)"
    )
    args = ap.parse_args()
    if args.comm_only:
        from _common import RESULTS

        data = json.loads((RESULTS / "dynamic_cp.json").read_text())
        data.pop("benchmark", None), data.pop("date", None), data.pop("machine", None)
        kept = [r for r in data.get("communication_rows", []) if r["distribution"] not in args.comm_traces]
        data["communication_rows"] = []
        for trace in args.comm_traces:
            lengths = load_trace(trace, seed=args.seed)
            cases = [(name, standard_topology(lengths, *spec)) for name, spec in TOPOLOGIES.items()]
            cases += [(TIGHT[1], tight_topology(lengths))] if trace == TIGHT[0] else []
            for name, topo in cases:
                if topo.dp * topo.cp > args.comm_max_pool:
                    continue
                c = comm_row(trace, name, lengths, topo, args.seed)
                data["communication_rows"].append(c)
                data["load_average"].append(os.getloadavg())
                print(f"comm model | {trace} | {name} | dynamic vs static: {c['predicted_speedup']:.3f}x", flush=True)
        data["communication_rows"] = sorted(
            kept + data["communication_rows"], key=lambda r: args_order(r["distribution"])
        )  # stable: each trace's rows keep their topology order
        print(f"wrote {write_result('dynamic_cp', data, clock='wall+process_cpu')}")
        return
    if args.table:
        from _common import RESULTS

        print(table(json.loads((RESULTS / "dynamic_cp.json").read_text())))
        return
    cost = DEFAULT_COST
    rows, comm_rows, loads = [], [], [os.getloadavg()]
    print("| distribution | topology | static efficiency | dynamic efficiency | plan CPU s static / dynamic | goals |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        cases = []
        for trace in args.traces:
            lengths = load_trace(trace, seed=args.seed)
            for name, (dp, cp, pp, m) in TOPOLOGIES.items():
                cases.append((trace, name, lengths, standard_topology(lengths, dp, cp, pp, m)))
            if trace == TIGHT[0]:
                cases.append((trace, TIGHT[1], lengths, tight_topology(lengths)))
        for trace, name, lengths, topo in cases:
            r = row(trace, name, lengths, topo, cost, args.seed, Path(tmp))
            rows.append(r)
            loads.append(os.getloadavg())
            ok = (
                "all met"
                if all(r["goals"].values())
                else "missed: " + ", ".join(k for k, v in r["goals"].items() if not v)
            )
            s, d = r["static"], r["dynamic"]
            print(
                f"| {trace} | {name} | {s['epoch_efficiency']:.4f} | {d['epoch_efficiency']:.4f} | "
                f"{s['plan_cpu_seconds']:.2f} / {d['plan_cpu_seconds']:.2f} | {ok} |",
                flush=True,
            )
        for trace, name, lengths, topo in cases:
            if trace in args.comm_traces and topo.dp * topo.cp <= args.comm_max_pool:
                c = comm_row(trace, name, lengths, topo, args.seed)
                comm_rows.append(c)
                loads.append(os.getloadavg())
                print(
                    f"comm model | {trace} | {name} | predicted speedup dynamic vs static {c['predicted_speedup']:.3f}"
                )
    if args.merge:
        from _common import RESULTS

        saved = json.loads((RESULTS / "dynamic_cp.json").read_text())
        keep = [r for r in saved["rows"] if r["distribution"] not in args.traces]
        names = [*TOPOLOGIES, TIGHT[1]]
        rows = sorted(keep + rows, key=lambda r: (args_order(r["distribution"]), names.index(r["topology"])))
        comm_rows = [r for r in saved.get("communication_rows", []) if r["distribution"] not in args.traces] + comm_rows
        loads = saved.get("load_average", []) + loads
    payload = {
        "cost": cost.to_dict(),
        "communication_model": comm_cost().to_dict(),
        "communication_rows": comm_rows,
        "load_average": loads,
        "rows": rows,
    }
    print(f"\nwrote {write_result('dynamic_cp', payload, clock='wall+process_cpu')}")


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_dynamic_cp() -> str:
    data = tb.load("dynamic_cp")
    rows = []
    for row in data["rows"]:
        static, dynamic = row["static"], row["dynamic"]
        rows.append(
            [
                row["distribution"],
                row["topology"],
                ",".join(str(size) for size in row["cp_sizes"]),
                tb.fmt(static["epoch_efficiency"], ".4f"),
                tb.fmt(dynamic["epoch_efficiency"], ".4f"),
                tb.fmt(static["imbalance"], ".4f"),
                tb.fmt(dynamic["imbalance"], ".4f"),
                tb.fmt(dynamic["plan_cpu_seconds"] / max(static["plan_cpu_seconds"], 1e-9), ".1f") + "x",
                tb.goals_cell(row.get("goals", {})),
            ]
        )
    header = ["distribution", "topology", "cp sizes", "static eff.", "dynamic eff.", "static imb.", "dynamic imb."]
    header += ["plan CPU time dyn/static", "goals"]
    return tb.markdown(header, rows) + tb.record_line(data)[:-1] + f"; {tb.commit_note(data)}."


def table_dynamic_cp_communication() -> str:
    data = tb.load("dynamic_cp")
    rows = [
        [
            row["distribution"],
            row["topology"],
            ",".join(str(size) for size in row["cp_sizes"]),
            tb.fmt(row["predicted_speedup"], ".3f") + "x",
            tb.fmt(row["rank_slots_on_groups_of_1"], ".2f"),
            tb.fmt(row["plan_cpu_seconds"]["dynamic"] / max(row["plan_cpu_seconds"]["static"], 1e-9), ".1f") + "x",
            tb.goals_cell(row["goals"]) if "goals" in row else "",
        ]
        for row in data["communication_rows"]
    ]
    header = ["distribution", "topology", "cp sizes", "predicted speedup", "share of rank-slots in groups of 1"]
    line = tb.record_line(data)[:-1] + f"; {tb.commit_note(data)}."
    return tb.markdown(header + ["plan CPU time dyn/static", "goals"], rows) + line


TABLES = {  # docs/ marker name -> the table, from the record
    "dynamic_cp": table_dynamic_cp,
    "dynamic_cp_communication": table_dynamic_cp_communication,
}


if __name__ == "__main__":
    main()
