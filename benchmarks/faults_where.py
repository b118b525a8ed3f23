"""Where a kill's seconds go in a torchft run (benchmarks/faults.py's faulty run, or any `faults_run.run` result):
per surviving replica group, each step's wall span (from the end of its previous step to the end of this one) split
into quorum + the step exchange (`next_step`), this group's compute, and the gradient reduction + `should_commit`;
a step's excess is its span over the group's median span, in steps more than 1.5x that median (the steps a kill
disturbs), and an uncommitted step's whole span is lost work. Totals over the surviving groups, per kill.
"""

from __future__ import annotations

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
