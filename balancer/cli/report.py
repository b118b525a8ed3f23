"""Length statistics and the side-by-side balance report printed by `balancer demo|plan|stats`."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from attention.geometry import attention_pairs
from balancer.files import atomic_write
from balancer.planning.cost.model import CostModel
from balancer.planning.plans.plan import Plan

THRESHOLDS = (8192, 32768, 131072)
ROWS = (
    "steps",
    "imbalance",
    "worst_step",
    "epoch_efficiency",
    "token_utilization",
    "padding_tokens",
    "dropped_tokens",
    "mean_delay_steps",
    "plan_seconds",
)


def length_stats(lengths: np.ndarray, cost: CostModel) -> dict:
    """Count, token and attention-work shares above 8K/32K/128K, and percentiles."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pairs = attention_pairs(lengths, cost.causal)
    out: dict[str, Any] = {
        "documents": int(len(lengths)),
        "tokens": int(lengths.sum()),
        "max": int(lengths.max()),
        "mean": float(lengths.mean()),
        "percentiles": {str(p): float(np.percentile(lengths, p)) for p in (50, 90, 99, 99.9)},
        "above": {},
    }
    for t in THRESHOLDS:
        over = lengths > t
        out["above"][str(t)] = {
            "documents": float(over.mean()),
            "tokens": float(lengths[over].sum() / lengths.sum()),
            "attention": float(pairs[over].sum() / pairs.sum()),
            "cost": float(cost.cost(lengths[over]).sum() / cost.cost(lengths).sum()),
        }
    return out


def format_stats(stats: dict, unit: str = "documents") -> str:
    """The statistics as text; `unit` names what each length is ("documents", or "rows" of a pretokenized folder
    whose long documents were split into windows)."""
    lines = [
        f"{unit} {stats['documents']:,}  tokens {stats['tokens']:,}  mean {stats['mean']:.0f}  "
        f"max {stats['max']:,}  p50 {stats['percentiles']['50']:.0f}  p99 {stats['percentiles']['99']:.0f}",
        f"{'length >':>10} {unit:>10} {'tokens':>8} {'attention':>10} {'cost':>7}",
    ]
    for t, row in stats["above"].items():
        lines.append(
            f"{int(t) // 1024:>9}K {row['documents']:>10.2%} {row['tokens']:>8.1%} "
            f"{row['attention']:>10.1%} {row['cost']:>7.1%}"
        )
    return "\n".join(lines)


def compare_table(plans: dict[str, Plan]) -> str:
    """Markdown-ish table of the section-3 metrics, one column per plan, plus the predicted step-time ratio
    against the last column (the baseline)."""
    return metrics_table({name: p.metrics() for name, p in plans.items()}, speedup=len(plans) > 1)


def metrics_table(metrics: dict[str, dict], speedup: bool = False, timed: bool = True) -> str:
    """The section-3 metrics (`Plan.metrics()` dicts, as a packed folder's manifest records them too), one column
    per entry; with `speedup`, the predicted step-time ratio against the last column. `timed=False` (a packed
    folder's manifest, which records no planning time so that its bytes repeat): no plan_seconds row, and the note
    says so."""
    names = list(metrics)
    width = max(14, *(len(n) + 2 for n in names))
    label = max(20, len(f"predicted speedup vs {names[-1]}") + 2 if speedup else 20)
    lines = [f"{'metric':<{label}}" + "".join(f"{n:>{width}}" for n in names), "-" * (label + width * len(names))]
    for row in ROWS if timed else [r for r in ROWS if r != "plan_seconds"]:
        cells = []
        for n in names:
            v = metrics[n][row]
            cells.append(f"{v:>{width},}" if isinstance(v, int) else f"{v:>{width}.4f}")
        lines.append(f"{row:<{label}}" + "".join(cells))
    if speedup:
        base = metrics[names[-1]]["step_time_total"]
        lines.append(
            f"{'predicted speedup vs ' + names[-1]:<{label}}"
            + "".join(f"{base / metrics[n]['step_time_total']:>{width}.3f}" for n in names)
        )
    lines.append(PREDICTED_NOTE if timed else UNTIMED_NOTE)
    return "\n".join(lines)


# what the table's figures are: the cost model's prediction for the plan, except the one clock reading
PREDICTED_NOTE = (
    "(imbalance, worst_step, epoch_efficiency and any speedup are predicted by the cost model for the plan, not "
    "timed; plan_seconds is measured. imbalance and worst_step are step times over their lower bound, not "
    "BalanceMonitor's measured_imbalance, the slowest replica over the mean)"
)
UNTIMED_NOTE = (
    "(imbalance, worst_step and epoch_efficiency are predicted by the cost model for the plan, not timed; the "
    "manifest records no planning time, so that packing the same input writes the same bytes. imbalance and "
    "worst_step are step times over their lower bound, not BalanceMonitor's slowest replica over the mean)"
)


def check_plot_path(path: str) -> str:
    """The picture format of `path` (its suffix: png, pdf, svg, ...), checked before any work: matplotlib is
    installed and writes that format. A ValueError naming --plot otherwise."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'seqbalancer[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(str(path))[1].lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(
            f"--plot {path}: the file name must end in a picture format matplotlib writes "
            f"({', '.join('.' + f for f in sorted(formats))}), got {'.' + suffix if suffix else 'no suffix'}"
        )
    return suffix


def plot(lengths: np.ndarray, cost: CostModel, path: str, plans: dict[str, Plan] | None = None) -> None:
    """A picture (format by suffix, written atomically): length histogram with token/attention shares by length
    and, given plans, their per-step balance."""
    fmt = check_plot_path(path)
    import matplotlib.pyplot as plt

    lengths = np.asarray(lengths, dtype=np.int64)
    ncols = 2 if plans else 1
    fig, axes = plt.subplots(1, ncols + 1, figsize=(6 * (ncols + 1), 4.2))
    bins = np.logspace(0, np.log10(lengths.max() + 1), 60)
    axes[0].hist(lengths, bins=bins, color="#4c72b0")
    axes[0].set_xscale("log"), axes[0].set_yscale("log")
    axes[0].set_xlabel("document length (tokens)"), axes[0].set_ylabel("documents")
    axes[0].set_title(f"{len(lengths):,} documents")
    srt = np.sort(lengths)
    for label, w in (
        ("tokens", srt.astype(float)),
        ("attention pairs", attention_pairs(srt, cost.causal)),
        ("cost", cost.cost(srt)),
    ):
        axes[1].plot(srt, 1 - np.cumsum(w) / w.sum(), label=label)
    axes[1].set_xscale("log"), axes[1].set_xlabel("document length (tokens)")
    axes[1].set_ylabel("share held by longer documents"), axes[1].legend(), axes[1].grid(alpha=0.3)
    if plans:
        from balancer.planning.metrics import lower_bound

        for name, p in plans.items():
            t = p.step_times()
            s_of = p.step_of_entry()
            c = p.cost_model.cost(p.end - p.start)
            work = np.bincount(s_of, weights=c, minlength=p.num_steps)
            mx = np.zeros(p.num_steps)
            np.maximum.at(mx, s_of, c)
            axes[2].plot(t / lower_bound(work, mx, p.topology, p.cost_model.fixed), label=name, lw=1)
        axes[2].set_xlabel("step"), axes[2].set_ylabel("step time / lower bound"), axes[2].legend()
        axes[2].set_title(str(next(iter(plans.values())).topology).split(", max")[0]), axes[2].grid(alpha=0.3)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, dpi=110, format=fmt))
    finally:
        plt.close(fig)
