"""Does scaling the refitted cost model to its evidence's median measured / predicted ratio lower the first fit's
error on fresh micro-batches? Offline, on the micro-batches that measured_balance.py recorded.

For every recorded run (static-CP configurations: `uneven`, `equal`, `cp2`; dynamic CP records no groups per
micro-batch) the first accepted refit is fitted again from the same evidence (the micro-batches of the windows up
to the one it was fitted after, the held-back steps left out as the live refit does), once with the least-squares
scale and once scaled to the median ratio, and both are scored on the micro-batches measured after the live fit
(none of them in the evidence), outliers left out by the report's rule. Same evidence, same fresh micro-batches:
the two variants differ in the scale alone. `replicates` checks the offline fit against the predictions the live
run recorded (equal to the last bit where the run had the same code).

    python benchmarks/refit_scale.py [--inputs measured_balance_interleaved,measured_balance_interleaved_cp,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import recorded_runs, table, write_result  # noqa: E402

CONFIGS = ("uneven", "equal", "cp2")
DEFAULT_INPUTS = ("measured_balance_interleaved", "measured_balance_interleaved_cp",
                  "measured_balance_interleaved@c02ed41", "measured_balance_interleaved_cp@c02ed41")  # fmt: skip
VARIANTS = {"least squares": False, "median-scaled": True}


def _first_fit_window(run: dict):
    accepted = [r["window"] for r in run["refits"] if r["accepted"]]
    return accepted[0] if accepted else None


def _errors(rows: np.ndarray, predicted: np.ndarray) -> dict:
    from balancer.measured.refit import outlier_mask

    seconds = rows[:, 7]
    keep = ~outlier_mask(seconds, predicted, rows[:, 3])
    e = np.abs(predicted[keep] - seconds[keep]) / seconds[keep]
    return {"median": float(np.median(e)), "p90": float(np.quantile(e, 0.9)),
            "median_ratio": float(np.median(seconds / predicted))}  # fmt: skip


def _run(run: dict, dp: int, cp: int) -> dict | None:
    """Both variants' first fit of `run` and their errors on its fresh micro-batches."""
    import balancer
    from balancer.calibration import TINY_LLAMA
    from balancer.measured.refit import HOLD_EVERY, Samples, fit, predict

    window = _first_fit_window(run)
    if window is None:
        return None
    rows = np.array(run["micro_batches"], dtype=np.float64).reshape(-1, 10)
    sizes = [np.asarray(s, dtype=np.int64) for s in run["micro_batch_sizes"]]
    everything = Samples(sizes, np.full(len(rows), cp), rows[:, 3].astype(np.int64), rows[:, 7],
                         rows[:, 0].astype(np.int64))  # fmt: skip
    like = balancer.CostModel.from_config(TINY_LLAMA)
    everything = everything.with_terms(like, "zigzag")
    train = (rows[:, 2] <= window) & (rows[:, 0] % HOLD_EVERY != HOLD_EVERY - 1)
    fresh = rows[:, 9] == 1
    out = {"evidence": int(train.sum()), "fresh": int(fresh.sum()), "first_fit_window": int(window)}
    for name, scaled in VARIANTS.items():
        cost, speeds, _ = fit(everything.take(train), like, dp, layout="zigzag", median_scale=scaled)
        pred = predict(cost, None, None, terms=everything.terms) / speeds[everything.replica]
        out[name] = {"fresh": _errors(rows[fresh], pred[fresh]),
                     "evidence_median_ratio": float(np.median(rows[train, 7] / pred[train]))}  # fmt: skip
        out[name]["replicates"] = float(np.max(np.abs(pred[fresh] / rows[fresh, 8] - 1)))
    out["recorded"] = _errors(rows[fresh], rows[fresh, 8])
    return out


def _summary(runs: list) -> list:
    """Per (record, configuration): median over runs of each variant's fresh median and p90 and evidence ratio."""
    rows = []
    for key in sorted({(r["record"], r["config"]) for r in runs}):
        mine = [r for r in runs if (r["record"], r["config"]) == key]
        row = [key[0], mine[0]["commit"][:7], key[1], str(len(mine))]
        for name in VARIANTS:
            med = np.median([r[name]["fresh"]["median"] for r in mine])
            p90 = np.median([r[name]["fresh"]["p90"] for r in mine])
            ratio = np.median([r[name]["evidence_median_ratio"] for r in mine])
            fresh_ratio = np.median([r[name]["fresh"]["median_ratio"] for r in mine])
            row += [f"{100 * med:.1f}% / {100 * p90:.1f}%", f"{ratio:.3f} / {fresh_ratio:.3f}"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--inputs", default=",".join(DEFAULT_INPUTS),
        help="comma-separated result names under benchmarks/results/ (measured_balance.py records)",
    )  # fmt: skip
    ap.add_argument("--output", default="refit_scale", help="result name (default refit_scale)")
    args = ap.parse_args(argv)
    runs = []
    for name, record, c, run in recorded_runs(args.inputs.split(","), CONFIGS, "refit_scale"):
        got = _run(run, c["dp"], c["cp"])
        if got is not None:
            runs.append({"record": name, "commit": record["git"]["commit"], "config": c["config"],
                         "pair": run["pair"], "mode": run["mode"], **got})  # fmt: skip
    columns = ["record", "its commit", "ranks", "runs"]
    for name in VARIANTS:
        columns += [f"{name}: fresh error median / p90", f"{name}: median ratio evidence / fresh"]
    tables = {"scale": table(columns, _summary(runs))}
    path = write_result(args.output, {"inputs": args.inputs.split(","), "runs": runs, "tables": tables},
                        clock="none")  # fmt: skip
    for row in tables["scale"]["rows"]:
        print(" | ".join(str(x) for x in row))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
