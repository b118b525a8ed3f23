"""`balancer demo`, `balancer plan` and `balancer stats`: plan lengths for a topology and print the balance report
beside token-count packing."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from balancer.cli.flags import check_counts
from balancer.cli.options import (
    add_topology_args,
    check_outputs,
    cost_from_args,
    cost_source,
    read_lengths,
    show_progress,
    topology_from_args,
)
from balancer.cli.report import compare_table, format_stats, length_stats, plot
from balancer.planning.baseline import token_count_plan
from balancer.planning.cost.model import CostModel
from balancer.planning.planner import plan as make_plan
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan


def default_plan_path(source: str, topo: Topology) -> Path:
    """Where `balancer plan` writes without -o: beside the input (for a folder: next to it, not inside), named after
    the input and the topology; for a built-in trace name: in the current folder."""
    src = Path(source)
    sizes = f"_cps{'-'.join(map(str, topo.group_sizes))}" if topo.dynamic else ""
    tag = f"plan_dp{topo.dp}_cp{topo.cp}{sizes}_pp{topo.pp}_m{topo.micro_batches}.json"
    if not src.exists():
        return Path(f"{source}.{tag}")
    src = src.resolve()
    stem = src.name if src.is_dir() else src.stem
    return src.parent / f"{stem}.{tag}"


def baseline_plan(ours: Plan, topo: Topology, cost: CostModel, seed: int) -> Plan:
    """Token-count packing of the same planning units as `ours` (with --overflow split/truncate: the same windows /
    truncated documents), so the two columns compare the same tokens."""
    return token_count_plan(ours.end - ours.start, topo, cost, seed=seed)


def _static_plan(lengths: np.ndarray, topo: Topology, cost: CostModel, args):
    """The static-CP plan a dynamic one is compared with, or None (with a note) when the documents do not fit."""

    try:
        return make_plan(
            lengths, dataclasses.replace(topo, cp_sizes=None), cost, seed=args.seed, overflow=args.overflow
        )
    except ValueError as e:
        print(f"(no static-CP comparison: {e})", file=sys.stderr)
        return None


def _plan_or_window(lengths: np.ndarray, topo: Topology, cost: CostModel, args):
    """The whole-epoch plan, or with --window-docs one window of epoch --epoch (balancer.plan_window)."""
    if (args.window_docs is None) != (args.window_index is None):
        raise ValueError("--window-docs and --window-index go together (one window of the epoch)")
    if args.window_docs is None:
        return make_plan(
            lengths, topo, cost, seed=args.seed, overflow=args.overflow, progress=show_progress(args),
            filler_rows=args.filler_rows,
        )  # fmt: skip
    if args.filler_rows:
        raise ValueError("--filler-rows plans a whole epoch: leave out --window-docs and --window-index")
    from balancer.planning.shuffle import num_windows
    from balancer.planning.window import plan_window

    args.epoch = 0 if args.epoch is None else args.epoch
    if args.window_docs < 1 or args.window_index < 0 or args.epoch < 0:
        raise ValueError("--window-docs must be >= 1, --window-index and --epoch >= 0")
    k = num_windows(len(lengths), min(args.window_docs, len(lengths)))
    if args.window_index >= k:
        raise ValueError(f"--window-index {args.window_index}: {len(lengths):,} documents in windows of "
                         f"--window-docs {args.window_docs} make {k} (0..{k - 1})")  # fmt: skip
    print(f"window {args.window_index} of {k} (epoch {args.epoch}, seed {args.seed})", file=sys.stderr)
    try:
        return plan_window(lengths, topo, cost, seed=args.seed, epoch=args.epoch, index=args.window_index,
                           window_docs=args.window_docs, overflow=args.overflow)  # fmt: skip
    except ValueError as e:
        raise ValueError(str(e).replace("window_docs", "--window-docs")) from None


def short_step_line(plan: Plan) -> str:
    """The line `plan` and `pack` print for a plan whose last step runs M' < micro_batches micro-batches."""
    t = plan.topology
    fillers = (
        f"; {plan.filler_rows} loss-masked filler row(s) added (--filler-rows), counted as padding_tokens"
        if plan.filler_rows
        else ""
    )
    return (
        f"the last step (step {plan.num_steps - 1}) runs {plan.last_micro_batches} of micro_batches = "
        f"{t.micro_batches} micro-batches on each of dp = {t.dp} replicas{fillers}"
    )


def cmd_plan(args: argparse.Namespace) -> int:
    if args.epoch is not None and args.window_docs is None:  # a whole-epoch plan has one order: its --seed
        raise ValueError(
            f"--epoch {args.epoch} picks the shuffle of one window of that epoch: pass --window-docs and "
            "--window-index with it (a whole-epoch plan's order is set by --seed)"
        )
    check_counts(args)
    check_outputs(args, {"-o": args.output, "--plot": args.plot})
    lengths = read_lengths(args.lengths)
    cost = cost_from_args(args)
    topo = topology_from_args(args, lengths)
    out = Path(args.output) if args.output else default_plan_path(args.lengths, topo)
    if args.window_docs is not None and not args.output:
        out = out.with_name(f"{out.stem}_window{args.window_index}{out.suffix}")
    if not args.output:
        check_outputs(args, {"the plan (default path, -o to change)": out, "--plot": args.plot})
    print(f"{len(lengths):,} documents, {int(lengths.sum()):,} tokens; {topo}", file=sys.stderr)
    print(cost_source(args, cost), file=sys.stderr)
    ours = _plan_or_window(lengths, topo, cost, args)
    plans = {"balancer (dynamic CP)" if topo.dynamic else "balancer": ours}
    if not args.no_baseline:
        static = ours
        if topo.dynamic:  # compare with fixed CP groups of size cp, when the documents fit them
            static = _static_plan(lengths, topo, cost, args)
            if static is not None:
                plans["balancer (static CP)"] = static
        if static is not None and static.filler_rows:
            print("(no token-count comparison: it would pack the filler rows as documents)", file=sys.stderr)
        elif static is not None:
            try:
                plans["token-count"] = baseline_plan(static, static.topology, cost, args.seed)
            except ValueError as e:  # it deals full steps only: a short last step has no token-count counterpart
                print(f"(no token-count comparison: {e})", file=sys.stderr)
    print(compare_table(plans))
    if ours.last_micro_batches < topo.micro_batches or ours.filler_rows:
        print(short_step_line(ours))
    if args.overflow != "error" and not args.no_baseline:
        print(f"(both columns plan the same units: documents after --overflow {args.overflow})")
    ours.save(out)
    print(f"wrote {out}", file=sys.stderr)
    if args.plot:
        plot(lengths, cost, args.plot, plans)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from balancer.data.traces import load_trace

    check_counts(args)
    check_outputs(args, {"--plot": args.plot})
    lengths = load_trace("wlbllm")
    cost = cost_from_args(args)
    topo = topology_from_args(args, lengths)
    print(
        "balancer demo: the built-in WLB-LLM length trace (hao-ai-lab/distca) planned for "
        f"{topo}\ncost: attention {cost.attn_coef:.3g} per causal pair + {cost.linear_coef:.3g} per token\n"
    )
    print(format_stats(length_stats(lengths, cost)) + "\n")
    plans = {
        "balancer": make_plan(lengths, topo, cost, seed=args.seed, progress=show_progress(args)),
        "token-count": token_count_plan(lengths, topo, cost, seed=args.seed),
    }
    print(compare_table(plans))
    m = {k: p.metrics() for k, p in plans.items()}
    print(
        f"\npredicted step time: {m['token-count']['step_time_total'] / m['balancer']['step_time_total']:.2f}x "
        "faster than token-count packing (if the cost model holds)"
    )
    if args.plot:
        plot(lengths, cost, args.plot, plans)
        print(f"wrote {args.plot}")
    return 0


def rows_note(source: str) -> str | None:
    """For a pretokenized folder whose rows are not one per document (split or truncated documents), what the rows
    are; None otherwise."""
    if not Path(source).is_dir():
        return None
    from balancer.data.shards.manifest import load_manifest

    counts = load_manifest(source).get("counts", {})
    rows, docs = counts.get("rows"), counts.get("documents")
    if rows is None or docs is None or (rows == docs and not counts.get("truncated_documents")):
        return None
    return (
        f"rows are what the planner sees: {rows:,} rows from {docs:,} documents "
        f"({counts.get('split_documents', 0):,} split into windows, {counts.get('truncated_documents', 0):,} "
        "truncated)"
    )


def cmd_stats(args: argparse.Namespace) -> int:
    check_counts(args)
    check_outputs(args, {"--plot": args.plot})
    lengths = read_lengths(args.lengths)
    cost = cost_from_args(args)
    note = rows_note(args.lengths)
    print(format_stats(length_stats(lengths, cost), unit="rows" if note else "documents"))
    if note:
        print(note)
    plans = None
    if not args.no_plan:
        topo = topology_from_args(args, lengths)
        print(f"\nbalance report for {topo}")
        ours = make_plan(lengths, topo, cost, seed=args.seed, overflow=args.overflow, progress=show_progress(args))
        plans = {"balancer": ours, "token-count": baseline_plan(ours, topo, cost, args.seed)}
        print(compare_table(plans))
    if args.plot:
        plot(lengths, cost, args.plot, plans)
        print(f"wrote {args.plot}")
    return 0


def register(sub: Any) -> None:
    """Add `demo`, `plan` and `stats` to an argparse subparsers object."""
    _register_demo(sub)
    _register_plan(sub)
    _register_stats(sub)


def _register_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="plan the built-in trace and compare with token-count packing",
        description="Plan the built-in WLB-LLM length trace for a topology (default dp8, 4 "
        "micro-batches) and print the balance report beside token-count packing.",
    )
    add_topology_args(p)
    p.add_argument("--plot", metavar="PNG", help="also write a picture of the lengths and per-step balance")
    p.set_defaults(func=cmd_demo)


def _register_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan an epoch for a topology and write the plan",
        description="Plan every step, replica and micro-batch of an epoch; print the metrics "
        "beside token-count packing; write the plan (JSON, or .npz by suffix).",
    )
    p.add_argument(
        "lengths",
        metavar="LENGTHS",
        help="JSON list / .npy / text file of lengths, a pretokenized folder, or a built-in trace name "
        "(wlbllm, prolong, sft, heavy: all ship with the package)",
    )
    add_topology_args(p)
    p.add_argument(
        "--cp-sizes",
        metavar="SIZES",
        help="dynamic CP: comma-separated CP group sizes, e.g. 1,2,4,8 (each dividing dp*cp); every micro-batch "
        "slot regroups the dp*cp ranks, giant documents on large groups, short ones on one rank; the plan is "
        "compared with the static one (default: fixed groups of --cp ranks)",
    )
    p.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default="error",
        help="documents longer than max_tokens*cp: error (default), split into windows, or truncate",
    )
    p.add_argument(
        "-o",
        "--output",
        help="plan file (.json or .npz); default: beside LENGTHS (for a folder: next to it, not inside), named "
        "LENGTHS.plan_dpD_cpC_ppP_mM.json; the path is printed",
    )
    p.add_argument("--plot", metavar="PNG", help="also write a picture of the lengths and per-step balance")
    p.add_argument("--no-baseline", action="store_true", help="skip the token-count comparison")
    p.add_argument(
        "--filler-rows",
        action="store_true",
        help="fixed-length rows that no short last step splits equally over the replicas: add the fewest "
        "loss-masked filler rows (copies of real rows whose labels are all ignored; recorded in the plan, the "
        "count printed) instead of refusing (whole-epoch plans)",
    )
    w = p.add_argument_group("one planning window (docs/windows.md; default: the whole epoch)")
    w.add_argument("--window-docs", type=int, metavar="N", help="documents per planning window, 1..2^62")
    w.add_argument("--window-index", type=int, metavar="I", help="which window of the epoch to plan, 0..2^62")
    w.add_argument(
        "--epoch", type=int, help="the epoch whose shuffle the windows cut, 0..2^63-1 (default 0; windows only)"
    )
    p.set_defaults(func=cmd_plan)


def _register_stats(sub) -> None:
    p = sub.add_parser(
        "stats",
        help="length statistics and a balance report",
        description="Length histogram, the share of tokens and of attention work above "
        "8K/32K/128K, and the balance report for a topology, as text and PNG.",
    )
    p.add_argument("lengths", metavar="LENGTHS", help="as for `plan`")
    add_topology_args(p)
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="error", help="as for `plan`")
    p.add_argument("--no-plan", action="store_true", help="statistics only, no balance report")
    p.add_argument("--plot", metavar="PNG", help="write the picture here")
    p.set_defaults(func=cmd_stats)
