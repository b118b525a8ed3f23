"""`balancer calibrate`: time a model's forward + backward on packed micro-batches, fit the cost model, write it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from balancer.calibration.run import DEFAULTS, STATISTICS
from balancer.cli.flags import count, limits
from balancer.data.output_paths import check_output_file
from balancer.limits import MAX_SEED, MAX_TOKENS
from balancer.planning.cost.fit import LOSSES
from balancer.planning.cost.model import CostModel
from balancer.strict_json import load_json

MAX_CP, MAX_BUDGET, MAX_THREADS, MAX_REPEATS = 32, 131072, 1024, 1000
MAX_TIMED_RUNS = 100_000  # micro-batches x CP sizes x layouts x runs each: hours on a CPU already


def _check_work(args) -> None:
    """Each count is bounded by its flag; their product too, before anything is timed."""
    from balancer.calibration.grid import KINDS

    batches = len(args.tokens) * (len(KINDS) * args.per_cell + args.fresh)
    layouts = sum(1 if cp == 1 else len(args.layout) for cp in args.cp)
    runs = batches * layouts * max(args.repeats, args.max_repeats)
    if runs > MAX_TIMED_RUNS:
        raise ValueError(
            f"--tokens x --per-cell / --fresh x --cp x --layout x --max-repeats make up to {runs:,} timed runs, "
            f"over the limit of {MAX_TIMED_RUNS:,}: lower one of them"
        )


def _config(args) -> dict | None:
    """The --model-config file, read strictly; the keys the cost model reads are checked here, before any timing."""
    from balancer.cli.options import flag_file

    if args.model_config is None:
        return None
    path = args.model_config
    config = flag_file("--model-config", path, load_json)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"--model-config {path}: a transformers config.json with a 'model_type' string is needed")
    CostModel.from_config({k: v for k, v in config.items() if k != "model_type"}, source=path)
    return config


def cmd_calibrate(args: argparse.Namespace) -> int:
    from balancer.calibration.run import calibrate

    check_output_file(args.output, [args.model_config], "-o")
    _check_work(args)
    result = calibrate(
        _config(args),
        cp_sizes=tuple(args.cp),
        layouts=tuple(args.layout),
        method=args.method,
        budgets=tuple(args.tokens),
        per_cell=args.per_cell,
        repeats=args.repeats,
        max_repeats=max(args.repeats, args.max_repeats),
        threads=args.threads,
        held_out=args.held_out,
        splits=args.splits,
        fresh_per_budget=args.fresh,
        seed=args.seed,
        split_threshold=args.split_threshold,
        clock=args.clock,
        statistic=args.statistic,
        loss=args.loss,
        progress=None if args.quiet else "bar" if sys.stderr.isatty() else "lines",
    )
    result.save(args.output)
    print(format_report(result.cost, result.report))
    for warning in result.report["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def format_report(cost: CostModel, report: dict) -> str:
    """A few lines: the fitted terms and the held-out errors."""
    lines = [
        f"fitted (seconds): attention {cost.attn_coef:.3g}/pair, linear {cost.linear_coef:.3g}/token, "
        f"fixed {cost.fixed:.3g}/micro-batch, piece {cost.piece_coef:.3g}, comm {cost.comm_coef:.3g}/token-hop, "
        f"latency {cost.comm_latency:.3g}/ring step, transfers {'overlapped' if cost.comm_overlap else 'added'}"
    ]
    for key, value in report.items():
        if key.startswith(("train", "held_out", "fresh")) and value.get("count"):
            lines.append(
                f"{key:>24}: {value['count']:3d} micro-batches, median |error| {100 * value['median_abs_error']:.1f}%, "
                f"p90 {100 * value['p90_abs_error']:.1f}%, max {100 * value['max_abs_error']:.1f}%"
            )
    splits = report.get("splits", {})
    if "median_abs_error" in splits:
        lines.append(
            f"{'held-out, ' + str(splits['count']) + ' splits':>24}: median |error| "
            f"{100 * splits['median_abs_error']:.1f}% (median over splits), worst p90 "
            f"{100 * splits['worst_p90_abs_error']:.1f}%" + (f", {splits['failed']} failed" if splits["failed"] else "")
        )
    lines += fresh_line(report)
    lines.append(f"clock: {report.get('clock_reason', report.get('clock'))}")
    return "\n".join(lines)


def fresh_line(report: dict) -> list[str]:
    """The headline figure: fresh micro-batches timed after the fit, against their target, with the load."""
    fresh = report.get("fresh", {})
    if not fresh.get("count"):
        return []
    before, grid = report.get("fresh_machine", {}), report.get("machine", {})
    verdict = "met" if fresh.get("meets_targets") else "MISSED"
    return [
        f"fresh micro-batches timed after the fit: {fresh['count']}, median |error| "
        f"{100 * fresh['median_abs_error']:.1f}%, p90 {100 * fresh['p90_abs_error']:.1f}% (target 10% / 20%: "
        f"{verdict}; load average {before['loadavg_before'][0]:.2f} on {before['cores']} cores before them, "
        f"{grid['loadavg_before'][0]:.2f} before the grid)"
    ]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="time a model on packed micro-batches and fit the cost model (-o cost.json)",
        description="Time forward + backward of a transformers model (a tiny Llama unless --model-config) on a grid "
        "of packed micro-batches (SFT-like, long-tail, mixed) for each CP size over gloo, fit every cost term "
        "(attention, linear, fixed, per-piece, communication), report the error on held-out micro-batches and write "
        "the model for `balancer plan --cost`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("-o", "--output", default="cost.json", help="where to write the fitted cost model (JSON)")
    p.add_argument("--model-config", help="a transformers config.json with model_type (random weights, no download)")
    p.add_argument(
        "--cp", type=count(1, MAX_CP), nargs="+", default=[1, 2], help=f"CP sizes to time, each {limits(1, MAX_CP)} "
        "(each a gloo world of that many processes)",
    )  # fmt: skip
    p.add_argument("--layout", nargs="+", default=["zigzag", "hybrid"], help="CP layouts to time for CP > 1")
    p.add_argument("--method", choices=("ring", "allgather"), default="ring", help="CP attention method")
    p.add_argument(
        "--tokens", type=count(16, MAX_BUDGET), nargs="+", default=list(DEFAULTS["budgets"]),
        help=f"micro-batch token budgets, each {limits(16, MAX_BUDGET)}",
    )  # fmt: skip
    p.add_argument(
        "--per-cell",
        type=count(1, MAX_REPEATS),
        default=DEFAULTS["per_cell"],
        help=f"micro-batches per (kind, budget) in the grid, {limits(1, MAX_REPEATS)}",
    )
    p.add_argument(
        "--repeats",
        type=count(1, MAX_REPEATS),
        default=DEFAULTS["repeats"],
        help=f"rounds of timed runs (each round times every micro-batch once), {limits(1, MAX_REPEATS)}",
    )
    p.add_argument(
        "--max-repeats",
        type=count(1, MAX_REPEATS),
        default=DEFAULTS["max_repeats"],
        help="further rounds for the micro-batches whose two fastest runs do not agree within 2%% yet, at most this "
        "many runs each "
        f"(raised to --repeats when below it), {limits(1, MAX_REPEATS)}",
    )
    p.add_argument(
        "--threads", type=count(1, MAX_THREADS), default=1, help=f"torch threads per process, {limits(1, MAX_THREADS)}"
    )
    p.add_argument(
        "--held-out",
        type=float,
        default=0.25,
        help="share of the grid's micro-batches kept out of the fit (with all their CP sizes and layouts)",
    )
    p.add_argument(
        "--splits",
        type=count(1, MAX_REPEATS),
        default=DEFAULTS["splits"],
        help=f"held-out splits to report (each fitted on its own), {limits(1, MAX_REPEATS)}",
    )
    p.add_argument(
        "--fresh",
        type=count(0, MAX_REPEATS),
        default=DEFAULTS["fresh_per_budget"],
        help="fresh micro-batches (other documents, budgets between and beyond --tokens) per budget, never fitted, "
        f"{limits(0, MAX_REPEATS)}",
    )
    p.add_argument(
        "--split-threshold", type=count(1, MAX_TOKENS),
        help=f"hybrid layout: split documents longer than this, {limits(1, MAX_TOKENS)}",
    )  # fmt: skip
    p.add_argument(
        "--clock",
        choices=("auto", "cpu", "wall"),
        default="auto",
        help="wall time, process CPU time, or auto: wall time when the machine was quiet while timing, else CPU time",
    )
    _fit_flags(p)
    p.add_argument("--seed", type=count(0, MAX_SEED), default=0, help=f"grid and held-out seed, {limits(0, MAX_SEED)}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress (a bar, or lines without a terminal)")
    p.set_defaults(func=cmd_calibrate)


def _fit_flags(p: argparse.ArgumentParser) -> None:
    """How the timings become a micro-batch's time and how they are fitted."""
    p.add_argument(
        "--statistic",
        choices=STATISTICS,
        default=DEFAULTS["statistic"],
        help="a micro-batch's time from its runs: the fastest (least disturbed) or the median",
    )
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default=DEFAULTS["loss"],
        help="the fit: least squares on relative errors, or robust to disturbed timings (huber: down-weighted "
        "beyond 1.345 robust scales; trim: dropped beyond 3)",
    )
