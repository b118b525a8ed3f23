"""Options shared by the `balancer` commands that plan (demo, plan, stats, pack): the topology and cost-model
arguments, turning them into `Topology` / `CostModel` objects, and the checks of their output files. Light: numpy
and the planning data model only."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from balancer.cli.flags import check_counts, limits, nonnegative
from balancer.cli.report import check_plot_path
from balancer.data.output_paths import check_output_file
from balancer.data.shards.errors import describe_os_error
from balancer.data.shards.lengths import read_lengths as read_any_lengths
from balancer.limits import MAX_RANKS, MAX_SEED, MAX_STEP_TOKENS, MAX_TOKENS
from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.planning.units import validate_lengths
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


def flag_file(flag: str, path: str, read: Callable[[str], Any]) -> Any:
    """`read(path)` for the file a flag names; a missing or unreadable file is a ValueError naming the flag."""
    try:
        return read(path)
    except OSError as e:
        raise ValueError(f"{flag} {describe_os_error(e)}") from None


def cost_from_args(args: argparse.Namespace) -> CostModel:
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
            model: dict[str, Any] = MODELS[args.model]
            cost = CostModel.from_model(**model)
        changes: dict[str, Any] = {"fixed": fixed, "causal": not args.non_causal}
        return replace(cost, **changes, **({} if window is None else {"window": window}))
    attn, lin = DEFAULT_COST
    return CostModel(
        attn_coef=args.attn_coef if args.attn_coef is not None else attn,
        linear_coef=args.linear_coef if args.linear_coef is not None else lin,
        fixed=fixed,
        causal=not args.non_causal,
        window=window,
    )


def cost_source(args: argparse.Namespace, cost: CostModel) -> str:
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


def topology_from_args(args: argparse.Namespace, lengths: np.ndarray) -> Topology:
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
    if topology.step_tokens < floor:
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


def check_outputs(args: argparse.Namespace, outputs: dict[str, str | Path | None]) -> None:
    """Before any work: every output (`flag -> path`) may be written: not an input (LENGTHS, --cost,
    --model-config), not inside an input folder or a balancer data folder, not the same file as another output;
    `--plot` has matplotlib and a picture suffix."""
    inputs = [p for name in ("lengths", "cost", "model_config") if (p := getattr(args, name, None)) is not None]
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        check_output_file(path, inputs, flag)
        real = os.path.realpath(path)
        if real in seen:
            raise ValueError(f"{seen[real]} and {flag} name the same file {path}: give two files")
        seen[real] = flag
    plot = outputs.get("--plot")
    if plot:
        check_plot_path(str(plot))


def show_progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()
