"""`plot_report(report, path)`: a PNG of a `BalanceMonitor.report()` (or its saved JSON): per replica, the measured
step time over the steps beside the plan's prediction scaled to the same mean, with window boundaries and refits
marked; the title gives the measured and predicted imbalance and the prediction error."""

from __future__ import annotations

import json
import os

import numpy as np


def plot_report(report: dict | str | os.PathLike, path: str | os.PathLike) -> str:
    """Draw `report` (a dict, or the path of a JSON file holding one) to the PNG `path`; returns the path."""
    if isinstance(report, (str, os.PathLike)):
        with open(report, encoding="utf-8") as f:
            report = json.load(f)
    if not isinstance(report, dict):
        raise ValueError(f"plot_report: the report is a {type(report).__name__}, not a dict of measured steps")
    series = report.get("series")
    if not series or not series.get("measured"):
        raise ValueError("plot_report: the report has no measured steps (series.measured is empty)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover
        raise ImportError("plot_report needs matplotlib: pip install 'seqbalancer[plot]'") from e
    meas, pred = np.asarray(series["measured"]), np.asarray(series["predicted"])
    pred = pred * (meas.mean() / pred.mean()) if pred.mean() > 0 else pred
    x = np.arange(len(meas))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for r in range(meas.shape[1]):
        (line,) = ax.plot(x, meas[:, r], lw=1.2, label=f"replica {r} measured")
        ax.plot(x, pred[:, r], lw=0.9, ls="--", color=line.get_color(), alpha=0.7)
    windows = np.asarray(series["window"])
    for b in np.flatnonzero(np.diff(windows) != 0) + 1:
        ax.axvline(b - 0.5, color="0.8", lw=0.8, zorder=0)
    ax.set_xlabel("step (warm-up left out); grey lines: window boundaries; dashed: predicted (scaled to the mean)")
    ax.set_ylabel("step compute time per replica (s)")
    ax.set_title(
        f"{report.get('mode')}: measured imbalance {report.get('measured_imbalance', float('nan')):.3f}, predicted "
        f"{report.get('predicted_imbalance', float('nan')):.3f}, prediction error median "
        f"{report.get('prediction_error_median', float('nan')):.1%}",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=min(4, meas.shape[1]), loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.fspath(path)
