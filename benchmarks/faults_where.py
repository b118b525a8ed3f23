"""Where a kill's seconds go in a torchft run (benchmarks/faults.py's faulty run, or any `faults_run.run` result):
per surviving replica group, each step's wall span (from the end of its previous step to the end of this one) split
into quorum + the step exchange (`next_step`), this group's compute, and the gradient reduction + `should_commit`;
a step's excess is its span over the group's median span, in steps more than 1.5x that median (the steps a kill
disturbs), and an uncommitted step's whole span is lost work. Totals over the surviving groups, per kill.

Run as a script, it measures the part of a rejoin the other groups wait for that is the data layer's (short, no
torchft run): the rejoining group's `load_state_dict` of the transferred data state and its first step's pieces,
before its first step exchange, with the state as sent (carrying the current window's plan) against the same state
without the plan (the group plans the window itself, as it did before the plan travelled with the state), and the
sender's `state_dict()` (torchft calls it while the step waits on the transfer): its first call at a position
(building the plan's part) and a later one.
Process CPU time, paired alternating repetitions; the record is benchmarks/results/faults_where_rejoin.json.

    .venv/bin/python benchmarks/faults_where.py [--reps 9] [--docs 1400]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import numpy as np

PARTS = ("quorum_and_exchange", "compute", "reduce_and_commit")


def spans(records: list) -> list[dict]:
    """Per step of one process life (sorted records): its span and the span's parts, in seconds."""
    out = []
    for prev, r in zip(records, records[1:]):
        span = r["t1"] - prev["t1"]
        quorum = r["t0"] - prev["t1"]
        out.append({"span": span, "quorum_and_exchange": quorum, "compute": r["compute"],
                    "reduce_and_commit": span - quorum - r["compute"], "committed": r["committed"]})  # fmt: skip
    return out


def where_seconds_go(lines: list, groups: int, kills: int) -> dict:
    """The excess seconds of disturbed steps by part, summed over every group's lives (rank 0), per kill; the
    uncommitted steps' count and seconds per kill; the median span."""
    totals = dict.fromkeys(PARTS, 0.0)
    lost_steps, lost_seconds, medians = 0, 0.0, []
    for g in range(groups):
        for life in sorted({r["life"] for r in lines if r["group"] == g}):
            records = sorted((r for r in lines if (r["group"], r["life"], r["rank"]) == (g, life, 0)),
                             key=lambda r: r["t1"])  # fmt: skip
            per = spans(records)
            if not per:
                continue
            median = {k: float(np.median([s[k] for s in per])) for k in ("span", *PARTS)}
            medians.append(median["span"])
            for s in per:
                if not s["committed"]:
                    lost_steps, lost_seconds = lost_steps + 1, lost_seconds + s["span"]
                elif s["span"] > 1.5 * median["span"]:
                    for k in PARTS:
                        totals[k] += max(0.0, s[k] - median[k])
    k = max(1, kills)
    return {
        "excess_seconds_per_kill": {p: v / k for p, v in totals.items()},
        "uncommitted_steps_per_kill": lost_steps / k,
        "uncommitted_seconds_per_kill": lost_seconds / k,
        "median_step_seconds": float(np.median(medians)) if medians else None,
        "note": "group-seconds summed over the groups (rank 0), divided by the kills",
    }


def _timed(fn) -> tuple[float, object]:
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def rejoin_work(docs: int, reps: int) -> dict:
    """Process CPU seconds per repetition (paired, alternating the order) of the rejoiner's work before its first
    step exchange, with and without the window's plan in the state, and of the sender's `state_dict()` (its first
    call at a position builds the plan's state, later ones return it); the pickled state's bytes. faults.py's
    corpus and topology (4 groups)."""
    import faults_run

    from balancer.integrations.torchft import FaultTolerantBatches

    cfg = faults_run.Config(out="", groups=4, docs=docs)
    lengths, topo, cost = cfg.lengths(), cfg.topology(), faults_run.cost_model()

    def fresh(name: str) -> FaultTolerantBatches:
        return FaultTolerantBatches(lengths, topo, cost, replica_id=name, seed=cfg.seed)

    sender = fresh("g0")
    sender.pieces()  # the sender planned its window (a live contributor has)
    state = sender.state_dict()
    if state["plan"] is None:
        raise RuntimeError("the sender's state carries no plan of its window")
    variants = {"with_plan": state, "without_plan": {**state, "plan": None}}
    times: dict[str, list[float]] = {k: [] for k in (*variants, "sender_first_call", "sender_again")}
    for r in range(reps):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        got = {}
        for name in order:
            receiver = fresh("g1")
            seconds, got[name] = _timed(lambda: (receiver.load_state_dict(variants[name]), receiver.pieces())[1])
            times[name].append(seconds)
        a, b = got["with_plan"], got["without_plan"]
        if not all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("doc", "start", "end", "full")):
            raise RuntimeError("the received plan's step differs from the one the receiver plans itself")
        again = fresh("g2")
        again.pieces()  # a sender that planned its window; its first state_dict at the position builds the plan's
        times["sender_first_call"].append(_timed(again.state_dict)[0])
        times["sender_again"].append(_timed(again.state_dict)[0])  # kept until the position moves
    median = {k: float(np.median(v)) for k, v in times.items()}
    ratios = [w / o for w, o in zip(times["with_plan"], times["without_plan"])]
    return {
        "docs": docs, "groups": cfg.groups, "window_steps": state["plan"]["steps"],
        "plan_pieces": len(state["plan"]["doc"]), "reps": reps, "seconds": times, "median_seconds": median,
        "rejoin_ratio_with_over_without": {"median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios)},
        "state_bytes": {k: len(pickle.dumps(v)) for k, v in variants.items()},
    }  # fmt: skip


def rejoin_table(result: dict) -> dict:
    """The record's table (docs/fault-tolerance.md renders it with benchmarks/tables.py)."""
    from _common import table

    t, ratio, size = result["seconds"], result["rejoin_ratio_with_over_without"], result["state_bytes"]

    def row(name: str, key: str) -> list:
        return [name, f"{np.median(t[key]):.4f}", f"{min(t[key]):.4f} - {max(t[key]):.4f}"]

    return table(
        ["process CPU seconds", "median", "min - max"],
        [
            row("rejoining group, planning the window itself (the state without the plan)", "without_plan"),
            row("rejoining group, the window's plan in the state", "with_plan"),
            ["rejoining group, with / without the plan (paired)", f"{ratio['median']:.4f}",
             f"{ratio['min']:.4f} - {ratio['max']:.4f}"],
            row("sending group's state_dict, first call at a position", "sender_first_call"),
            row("sending group's state_dict, again at the same position", "sender_again"),
            ["data state, pickled bytes (without / with the plan)", f"{size['without_plan']} / {size['with_plan']}",
             "-"],
        ],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--docs", type=int, default=1400)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_result

    result = rejoin_work(args.docs, args.reps)
    path = write_result("faults_where_rejoin", {**result, "tables": {"rejoin": rejoin_table(result)}},
                        clock="process_cpu")  # fmt: skip
    m = result["median_seconds"]
    print(f"rejoiner before its first exchange: {m['without_plan']:.4f} s CPU planning the window itself, "
          f"{m['with_plan']:.4f} s with the plan in the state; sender state_dict {m['sender_first_call']:.4f} s "
          f"(first call at a position), {m['sender_again']:.4f} s (again); state {result['state_bytes']} bytes; "
          f"{path}")  # fmt: skip


if __name__ == "__main__":
    main()
