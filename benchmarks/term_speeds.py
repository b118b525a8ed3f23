"""Would a speed per cost term and rank predict the uneven ranks better than one speed per rank? Offline, on the
micro-batches that measured_balance.py recorded (CP 1 configurations).

The refit gives every replica one speed: `seconds = cost(micro-batch) / speed[replica]`. When a rank's attention
and its token-linear work slow differently (a rank alone on a core against ranks sharing one: their caches differ,
and so do attention-bound and token-bound steps), one speed cannot be right for both. The most a speed per term
can give is a cost model per replica (attention pairs, tokens, a constant, pieces: each its own coefficient per
replica). For every recorded run both are fitted on the same evidence, the micro-batches of windows 0..E-1
(`--evidence`, default 4: every replica then has about 32), and scored on the later windows' micro-batches (none
in the evidence), outliers left out by the report's rule, per replica: the replica alone on its core (replica 0 of
`uneven`) is where the two differ. Also given: the error of each model's predicted step imbalance (slowest
replica's predicted step time over the replicas' mean, against the measured one) on the fresh steps, since the
planner balances steps.

    python benchmarks/term_speeds.py [--inputs measured_balance_interleaved,...] [--evidence 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import recorded_runs, table, write_result  # noqa: E402

CONFIGS = ("uneven", "equal")
DEFAULT_INPUTS = ("measured_balance_interleaved", "measured_balance_interleaved@c02ed41")


def _per_replica(samples, like, dp: int) -> list:
    """One cost model per replica (no shared speed): the refit's cost fit on each replica's samples alone."""
    from balancer.measured.refit import fit

    mine = [samples.take(samples.replica == r) for r in range(dp)]
    return [fit(dataclasses.replace(m, replica=np.zeros(len(m), dtype=np.int64)), like, 1, speeds=False)[0]
            for m in mine]  # fmt: skip


def _errors(seconds, pred, replica, dp: int) -> dict:
    from balancer.measured.refit import outlier_mask

    keep = ~outlier_mask(seconds, pred, replica)
    e = np.abs(pred - seconds) / seconds
    per = [float(np.median(e[keep & (replica == r)])) for r in range(dp)]
    return {"median": float(np.median(e[keep])), "p90": float(np.quantile(e[keep], 0.9)), "replica_median": per}


def _step_imbalance_error(rows: np.ndarray, pred: np.ndarray, dp: int) -> float:
    """Median over fresh steps of |predicted - measured| / measured step imbalance (max / mean of replica totals)."""
    out = []
    for step in np.unique(rows[:, 0]):
        k = rows[:, 0] == step
        meas, p = np.zeros(dp), np.zeros(dp)
        np.add.at(meas, rows[k, 3].astype(int), rows[k, 7])
        np.add.at(p, rows[k, 3].astype(int), pred[k])
        if meas.min() > 0 and p.min() > 0:
            m_imb, p_imb = meas.max() / meas.mean(), p.max() / p.mean()
            out.append(abs(p_imb - m_imb) / m_imb)
    return float(np.median(out)) if out else float("nan")


def _run(run: dict, dp: int, evidence: int) -> dict:
    import balancer
    from balancer.calibration import TINY_LLAMA
    from balancer.measured.refit import Samples, fit, predict

    rows = np.array(run["micro_batches"], dtype=np.float64).reshape(-1, 10)
    sizes = [np.asarray(s, dtype=np.int64) for s in run["micro_batch_sizes"]]
    like = balancer.CostModel.from_config(TINY_LLAMA)
    every = Samples(sizes, np.ones(len(rows), dtype=np.int64), rows[:, 3].astype(np.int64), rows[:, 7],
                    rows[:, 0].astype(np.int64)).with_terms(like, "zigzag")  # fmt: skip
    train, fresh = rows[:, 2] < evidence, rows[:, 2] >= evidence
    cost, speeds, _ = fit(every.take(train), like, dp)
    one = predict(cost, None, None, terms=every.terms) / speeds[every.replica]
    models = _per_replica(every.take(train), like, dp)
    per = np.array([float(predict(models[r], None, None, terms=[t])[0]) for r, t in zip(every.replica, every.terms)])
    seconds, replica = rows[fresh, 7], every.replica[fresh]
    return {
        "evidence_per_replica": [int((train & (every.replica == r)).sum()) for r in range(dp)],
        "fresh": int(fresh.sum()),
        "one speed per replica": {**_errors(seconds, one[fresh], replica, dp),
                                  "step_imbalance_error": _step_imbalance_error(rows[fresh], one[fresh], dp)},
        "a cost model per replica": {**_errors(seconds, per[fresh], replica, dp),
                                     "step_imbalance_error": _step_imbalance_error(rows[fresh], per[fresh], dp)},
        "attention share per replica": [_attention_share(m, every.take(train)) for m in models],
        "speeds": [float(x) for x in speeds],
        "cost": dataclasses.asdict(cost),
    }  # fmt: skip


def _attention_share(model, samples) -> float:
    """The attention term's share of the replica model's predicted time over the evidence (all replicas' samples)."""
    pairs = sum(float(t.pairs.sum()) for t in samples.terms)
    total = sum(float(model.attn_coef * t.pairs.sum() + model.linear_coef * t.tokens.sum() + model.fixed
                      + model.piece_coef * t.pieces.sum()) for t in samples.terms)  # fmt: skip
    return model.attn_coef * pairs / total if total > 0 else float("nan")


def _summary(runs: list) -> list:
    rows = []
    for key in sorted({(r["record"], r["config"]) for r in runs}):
        mine = [r for r in runs if (r["record"], r["config"]) == key]
        row = [key[0], mine[0]["commit"][:7], key[1], str(len(mine))]
        for name in ("one speed per replica", "a cost model per replica"):
            med = np.median([r[name]["median"] for r in mine])
            p90 = np.median([r[name]["p90"] for r in mine])
            r0 = np.median([r[name]["replica_median"][0] for r in mine])
            rest = np.median([np.median(r[name]["replica_median"][1:]) for r in mine])
            imb = np.median([r[name]["step_imbalance_error"] for r in mine])
            row += [f"{100 * med:.1f}% / {100 * p90:.1f}%", f"{100 * r0:.1f}% / {100 * rest:.1f}%", f"{100 * imb:.1f}%"]
        shares = np.median([r["attention share per replica"] for r in mine], axis=0)
        row.append(", ".join(f"{x:.2f}" for x in shares))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", default=",".join(DEFAULT_INPUTS), help="comma-separated measured_balance records")
    ap.add_argument("--evidence", type=int, default=4, help="windows of evidence (the rest are fresh; default 4)")
    ap.add_argument("--output", default="term_speeds", help="result name (default term_speeds)")
    args = ap.parse_args(argv)
    runs = []
    for name, record, c, run in recorded_runs(args.inputs.split(","), CONFIGS, "term_speeds"):
        got = _run(run, c["dp"], args.evidence)
        runs.append({"record": name, "commit": record["git"]["commit"], "config": c["config"],
                     "pair": run["pair"], "mode": run["mode"], **got})  # fmt: skip
    columns = ["record", "its commit", "ranks", "runs"]
    for name in ("one speed", "a model per replica"):
        columns += [f"{name}: fresh error median / p90", f"{name}: replica 0 / the others (median)",
                    f"{name}: step imbalance error"]  # fmt: skip
    columns.append("attention share of each replica's model")
    tables = {"terms": table(columns, _summary(runs))}
    path = write_result(args.output, {"inputs": args.inputs.split(","), "evidence_windows": args.evidence,
                                      "runs": runs, "tables": tables}, clock="none")  # fmt: skip
    for row in tables["terms"]["rows"]:
        print(" | ".join(row))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
