"""The `balancer` command: demo, plan, stats (and pretokenize, verify, merge from balancer.cli.data)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from balancer import __version__
from balancer.cli.flags import (
    MAX_RANKS,
    MAX_SEED,
    MAX_STEP_TOKENS,
    MAX_TOKENS,
    OneLineParser,
    check_counts,
    limits,
    nonnegative,
    parse_with_checks,
)
from balancer.cli.report import check_plot_path, compare_table, format_stats, length_stats, plot
from balancer.data.shards.errors import describe_os_error
from balancer.data.shards.lengths import read_lengths as read_any_lengths
from balancer.files import check_output_file
from balancer.planning.baseline import token_count_plan
from balancer.planning.cost import CostModel
from balancer.planning.planner import OVERFLOW_POLICIES, validate_lengths
from balancer.planning.planner import plan as make_plan
from balancer.planning.topology import Topology
from balancer.strict_json import load_json

# Llama-style configs for --model (analytic FLOPs via CostModel.from_model)
MODELS = {
    "llama2-7b": dict(
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=11008, vocab_size=32000
    ),
    "llama3-8b": dict(
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256
    ),
    "llama3-70b": dict(
        hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, intermediate_size=28672, vocab_size=128256
    ),
}
DEFAULT_COST = (2 / 53000, 1.0)  # attention cost per causal pair, linear cost per token (attention = linear at 53K)


def read_lengths(source: str) -> np.ndarray:
    """Lengths to plan from a JSON list, a .npy/.npz file, a text file of one length per line, a pretokenized
    folder or a built-in trace name (`balancer.data.shards.lengths.read_lengths`), checked by the planner's rules."""
    return validate_lengths(read_any_lengths(source), name=str(source))


def flag_file(flag: str, path: str, read):
    """`read(path)` for the file a flag names; a missing or unreadable file is a ValueError naming the flag."""
    try:
        return read(path)
    except OSError as e:
        raise ValueError(f"{flag} {describe_os_error(e)}") from None


def cost_from_args(args) -> CostModel:
    """The cost model the flags ask for (conflicting flags were refused by `flags.check_conflicts`): `--cost`, or
    `--model` / `--model-config` (with `--fixed`, `--window`, `--non-causal` applied), or the coefficients."""
    if getattr(args, "cost", None):
        return flag_file("--cost", args.cost, CostModel.load)
    window = getattr(args, "window", None)
    fixed = getattr(args, "fixed", None)
    fixed = 0.0 if fixed is None else fixed
    if getattr(args, "model_config", None) or getattr(args, "model", None):
        if getattr(args, "model_config", None):
            config = flag_file("--model-config", args.model_config, load_json)
            cost = CostModel.from_config(config, source=args.model_config)
        else:
            cost = CostModel.from_model(**MODELS[args.model])
        changes = {"fixed": fixed, "causal": not args.non_causal}
        return replace(cost, **changes, **({} if window is None else {"window": window}))
    attn, lin = DEFAULT_COST
    return CostModel(
        attn_coef=args.attn_coef if args.attn_coef is not None else attn,
        linear_coef=args.linear_coef if args.linear_coef is not None else lin,
        fixed=fixed,
        causal=not args.non_causal,
        window=window,
    )


def cost_source(args, cost: CostModel) -> str:
    """One line: which cost model a command uses and where it comes from."""
    if getattr(args, "cost", None):
        where = f"--cost {args.cost}"
    elif getattr(args, "model_config", None):
        where = f"--model-config {args.model_config} (analytic FLOPs)"
    elif getattr(args, "model", None):
        where = f"--model {args.model} (analytic FLOPs)"
    elif args.attn_coef is not None or args.linear_coef is not None:
        where = "--attn-coef / --linear-coef"
    else:
        where = "the default (attention = linear work at 53K tokens)"
    mask = ("causal" if cost.causal else "non-causal") + (f", window {cost.window}" if cost.window else "")
    return (
        f"cost model: {where}: attention {cost.attn_coef:.3g}/pair ({mask}), linear {cost.linear_coef:.3g}/token, "
        f"fixed {cost.fixed:.3g}/micro-batch"
    )


def parse_cp_sizes(text: str | None) -> tuple[int, ...] | None:
    """`--cp-sizes 1,2,4,8` -> (1, 2, 4, 8); a ValueError naming the option otherwise."""
    if text is None:
        return None
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--cp-sizes must be comma-separated group sizes such as 1,2,4,8, got {text!r}") from None
    too_big = [size for size in sizes if size > MAX_RANKS]
    if too_big:
        raise ValueError(f"--cp-sizes: size {too_big[0]} is above the maximum of 2^20 ranks")
    return sizes


def topology_from_args(args, lengths: np.ndarray) -> Topology:
    check_counts(args)
    max_tokens = args.max_tokens
    cp_sizes = parse_cp_sizes(getattr(args, "cp_sizes", None))
    if max_tokens is None:  # the next power of two that holds the longest document over the CP group
        max_tokens = 1 << int(np.ceil(np.log2(max(1, -(-int(lengths.max()) // args.cp)))))
        if max_tokens > MAX_TOKENS:
            raise ValueError(
                f"document {int(np.argmax(lengths))} has {int(lengths.max()):,} tokens: no micro-batch holds it "
                f"(--max-tokens is at most 2^40 per CP rank); check the lengths, or pass --max-tokens with "
                "--overflow split or truncate"
            )
    tps, fill = args.tokens_per_step, args.fill
    if fill is not None and not 0 < fill <= 1:  # also NaN and inf
        raise ValueError(f"--fill must be a share of the capacity in (0, 1], got {fill}")
    if fill is not None:
        capacity = args.dp * args.cp * args.micro_batches * max_tokens
        tps = int(fill * capacity)
        if tps < 1:
            raise ValueError(f"--fill {fill} of a capacity of {capacity:,} tokens is less than one token per step")
    topology = Topology(
        dp=args.dp,
        cp=args.cp,
        pp=args.pp,
        micro_batches=args.micro_batches,
        max_tokens=max_tokens,
        tokens_per_step=tps,  # None: the Topology default
        cp_sizes=cp_sizes,
    )
    if tps is not None:  # the default is never below the floor
        _check_step_budget(topology, lengths, args, "--fill" if fill is not None else "--tokens-per-step")
    return topology


def _check_step_budget(topology: Topology, lengths: np.ndarray, args, flag: str) -> None:
    """A step budget below half an average planning unit per micro-batch cannot be met (every micro-batch holds
    at least one) and makes about one step per document: minutes of planning for nothing. Refused up front."""
    unit = float(np.minimum(lengths, topology.max_tokens * topology.largest_group).mean())
    floor = topology.bins_per_step * unit / 2
    if topology.tokens_per_step < floor:
        raise ValueError(
            f"{flag} gives {topology.tokens_per_step:,} tokens per step, less than half an average document "
            f"({unit:,.0f} tokens) for each of the dp*micro_batches = {topology.bins_per_step} micro-batches (at "
            f"least {int(np.ceil(floor)):,}): every micro-batch holds at least one document"
        )


def add_topology_args(p: argparse.ArgumentParser, dp: int = 8, micro_batches: int = 4) -> None:
    ranks = int  # ranges: flags.check_counts, inside the command (pack reports them its own way)
    g = p.add_argument_group(f"topology (counts up to {MAX_RANKS:,} = 2^20)")
    g.add_argument("--dp", type=ranks, default=dp, help=f"data-parallel replicas (default {dp})")
    g.add_argument("--cp", type=ranks, default=1, help="context-parallel ranks per replica (default 1)")
    g.add_argument("--pp", type=ranks, default=1, help="pipeline stages (default 1)")
    g.add_argument(
        "--micro-batches",
        type=ranks,
        default=micro_batches,
        help=f"micro-batches per replica per step (default {micro_batches})",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens per CP rank per micro-batch, {limits(1, MAX_TOKENS)} (default: next power of two >= longest "
        "document / cp)",
    )
    g.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        help=f"global batch in tokens, {limits(1, MAX_STEP_TOKENS)}, at least half an average document per "
        "micro-batch (default: 85%% of the capacity)",
    )
    g.add_argument(
        "--fill",
        type=float,
        default=None,
        help="tokens_per_step as a share in (0, 1] of the capacity dp*cp*micro_batches*max_tokens (default 0.85); "
        "not with --tokens-per-step",
    )
    c = p.add_argument_group(
        "cost model (default: attention 2/53000 per causal pair + 1 per token; --cost, --model and --model-config "
        "exclude the coefficients, --cost everything else)"
    )
    c.add_argument("--model", choices=sorted(MODELS), help="derive the cost from a built-in Llama-style config")
    c.add_argument("--model-config", help="derive the cost from a Hugging Face config.json")
    c.add_argument("--attn-coef", type=nonnegative, help="cost per causal (query, key) pair")
    c.add_argument("--linear-coef", type=nonnegative, help="cost per token")
    c.add_argument("--fixed", type=nonnegative, help="cost per micro-batch (default 0)")
    c.add_argument("--non-causal", action="store_true", help="bidirectional attention: d*d pairs per document")
    c.add_argument(
        "--window",
        type=int,
        help=f"sliding-window attention: keys per query, {limits(1, MAX_TOKENS)} (pairs ~ d*window)",
    )
    c.add_argument("--cost", metavar="JSON", help="a fitted cost model (`balancer calibrate -o cost.json`)")
    p.add_argument("--seed", type=int, default=0, help=f"shuffle seed, {limits(0, MAX_SEED)} (default 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (there is none without a terminal)")


def default_plan_path(source: str, topo: Topology) -> Path:
    """Where `balancer plan` writes without -o: beside the input (for a folder: next to it, not inside), named after
    the input and the topology; for a built-in trace name: in the current folder."""
    src = Path(source)
    sizes = f"_cps{'-'.join(map(str, topo.cp_sizes))}" if topo.dynamic else ""
    tag = f"plan_dp{topo.dp}_cp{topo.cp}{sizes}_pp{topo.pp}_m{topo.micro_batches}.json"
    if not src.exists():
        return Path(f"{source}.{tag}")
    src = src.resolve()
    stem = src.name if src.is_dir() else src.stem
    return src.parent / f"{stem}.{tag}"


def check_outputs(args, outputs: dict[str, str | Path | None]) -> None:
    """Before any work: every output (`flag -> path`) may be written: not an input (LENGTHS, --cost,
    --model-config), not inside an input folder or a balancer data folder, not the same file as another output;
    `--plot` has matplotlib and a picture suffix."""
    inputs = [getattr(args, name, None) for name in ("lengths", "cost", "model_config")]
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        check_output_file(path, inputs, flag)
        real = os.path.realpath(path)
        if real in seen:
            raise ValueError(f"{seen[real]} and {flag} name the same file {path}: give two files")
        seen[real] = flag
    if outputs.get("--plot"):
        check_plot_path(outputs["--plot"])


def show_progress(args) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def baseline_plan(ours, topo: Topology, cost: CostModel, seed: int):
    """Token-count packing of the same planning units as `ours` (with --overflow split/truncate: the same windows /
    truncated documents), so the two columns compare the same tokens."""
    return token_count_plan(ours.end - ours.start, topo, cost, seed=seed)


def _static_plan(lengths: np.ndarray, topo: Topology, cost: CostModel, args):
    """The static-CP plan a dynamic one is compared with, or None (with a note) when the documents do not fit."""
    import dataclasses

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
        return make_plan(lengths, topo, cost, seed=args.seed, overflow=args.overflow, progress=show_progress(args))
    from balancer.planning.window import num_windows, plan_window

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


def cmd_plan(args) -> int:
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
        if static is not None:
            plans["token-count"] = baseline_plan(static, static.topology, cost, args.seed)
    print(compare_table(plans))
    if args.overflow != "error" and not args.no_baseline:
        print(f"(both columns plan the same units: documents after --overflow {args.overflow})")
    ours.save(out)
    print(f"wrote {out}", file=sys.stderr)
    if args.plot:
        plot(lengths, cost, args.plot, plans)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
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


def cmd_stats(args) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="balancer",
        description=(
            "Sequence-length-aware packing and DP x CP x PP scheduling: every rank gets equal work, counting "
            "attention's quadratic cost, not just tokens."
        ),
    )
    parser.add_argument("--version", action="version", version=f"balancer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "demo",
        help="plan the built-in trace and compare with token-count packing",
        description="Plan the built-in WLB-LLM length trace for a topology (default dp8, 4 "
        "micro-batches) and print the balance report beside token-count packing.",
    )
    add_topology_args(p)
    p.add_argument("--plot", metavar="PNG", help="also write a picture of the lengths and per-step balance")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "plan",
        help="plan an epoch for a topology and write the plan",
        description="Plan every step, replica and micro-batch of an epoch; print the metrics "
        "beside token-count packing; write the plan (JSON, or .npz by suffix).",
    )
    p.add_argument(
        "lengths",
        metavar="LENGTHS",
        help="JSON list / .npy / text file of lengths, a pretokenized folder, or a built-in trace name",
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
    w = p.add_argument_group("one planning window (docs/windows.md; default: the whole epoch)")
    w.add_argument("--window-docs", type=int, metavar="N", help="documents per planning window (>= 1)")
    w.add_argument("--window-index", type=int, metavar="I", help="which window of the epoch to plan (0-based)")
    w.add_argument("--epoch", type=int, default=0, help="the epoch whose shuffle the windows cut (default 0)")
    p.set_defaults(func=cmd_plan)

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

    from balancer.cli import calibrate as cli_calibrate
    from balancer.cli import data as cli_data

    cli_data.register(sub)
    cli_calibrate.register(sub)
    return parser


def cli_message(message: str) -> str:
    """Library errors speak Python (`overflow='split'`, `Topology.max_tokens`); on the command line, name the flags."""
    message = re.sub(r"\boverflow='(\w+)'( \([^)]*\))? or '(\w+)'", r"--overflow \1\2 or --overflow \3", message)
    message = re.sub(r"\boverflow='(\w+)'", r"--overflow \1", message)
    message = re.sub(r"\bTopology\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
    message = re.sub(r"\braise max_tokens or cp\b", "raise --max-tokens or --cp", message)
    return re.sub(r"\blower dp or micro_batches\b", "lower --dp or --micro-batches", message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_with_checks(parser, argv)
    except SystemExit as e:  # a refused flag (one line printed), --help, --version: a code, for in-process callers
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"balancer {args.command}: error: {cli_message(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"balancer {args.command}: error: {describe_os_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
