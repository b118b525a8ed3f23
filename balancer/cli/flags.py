"""Command-line flags: bounded numeric types, one-line argparse errors, and options that conflict.

Every count flag has a maximum, checked before any work starts and shown in `--help`: a command's own counts by
argparse types (`count`), the shared planning flags by `check_counts` inside each command (so `pack` reports them
through its own error path). Every error is one line `balancer COMMAND: error: ...` with exit code 2.
`check_conflicts` refuses two options given together when one would silently override the other (`--cost` with
`--window`), naming both; `main` runs it for every command, so every command that takes the shared flags (plan,
stats, demo, pack) gets the same rules.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from typing import NoReturn, Optional

from balancer.limits import (
    MAX_COEFFICIENT,
    MAX_RANKS,
    MAX_SEED,
    MAX_STEP_TOKENS,
    MAX_TOKENS,
    bound_text,
    out_of_range,
    range_error,
    shown,
)


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (`balancer plan: error: argument --dp: ...`), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# the shared planning flags: dest -> (flag, lowest, highest); checked by `check_counts` inside each command (so
# `pack` reports them through its own error path, like its other counts)
COUNT_LIMITS = {
    "dp": ("--dp", 1, MAX_RANKS),
    "cp": ("--cp", 1, MAX_RANKS),
    "pp": ("--pp", 1, MAX_RANKS),
    "micro_batches": ("--micro-batches", 1, MAX_RANKS),
    "max_tokens": ("--max-tokens", 1, MAX_TOKENS),
    "tokens_per_step": ("--tokens-per-step", 1, MAX_STEP_TOKENS),
    "window": ("--window", 1, MAX_TOKENS),
    "seed": ("--seed", 0, MAX_SEED),
    "window_docs": ("--window-docs", 1, MAX_STEP_TOKENS),
    "window_index": ("--window-index", 0, MAX_STEP_TOKENS),
    "epoch": ("--epoch", 0, MAX_SEED),
}


def check_counts(args: argparse.Namespace, limits: dict = COUNT_LIMITS) -> None:
    """Every count flag given within its range (ValueError `--dp must be in [1, 2^20], got ...`)."""
    for dest, (flag, lo, hi) in limits.items():
        value = getattr(args, dest, None)
        if value is not None and not lo <= value <= hi:
            raise ValueError(range_error(flag, value, lo, hi))


def count(lo: int, hi: Optional[int]) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi] (also refuses 99999999999999999999 before any work); for the flags
    of one command only (the shared planning flags are checked by `check_counts`). `hi` None: only `lo` here, the
    command checks the maximum itself (the data commands, whose API names the argument)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if hi is None and value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {shown(text)}")
        if hi is not None and not lo <= value <= hi:
            raise argparse.ArgumentTypeError(out_of_range(text, lo, hi))
        return value

    parse.__name__ = "integer"
    return parse


def nonnegative(text: str) -> float:
    """argparse type: a cost coefficient, a finite number in [0, MAX_COEFFICIENT]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_COEFFICIENT:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 and <= {MAX_COEFFICIENT:g}, got {shown(text)}")
    return value


nonnegative.__name__ = "number"


def limits(lo: int, hi: int) -> str:
    """The range text a --help line ends with."""
    return f"{bound_text(lo)}..{bound_text(hi)}"


# (flag, flags it conflicts with, why): both given is refused, naming both
CONFLICTS = (
    ("--cost", ("--model", "--model-config", "--attn-coef", "--linear-coef", "--fixed", "--non-causal", "--window"),
     "a fitted cost model is complete"),
    ("--model", ("--model-config", "--attn-coef", "--linear-coef"), "the model's FLOPs give the coefficients"),
    ("--model-config", ("--attn-coef", "--linear-coef"), "the config's FLOPs give the coefficients"),
    ("--tokens-per-step", ("--fill",), "--fill sets tokens_per_step as a share of the capacity"),
    ("--no-plan", ("--dp", "--cp", "--pp", "--micro-batches", "--max-tokens", "--tokens-per-step", "--fill",
                   "--overflow", "--seed"), "without a plan the topology is not used"),
)  # fmt: skip


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The long flags given on the command line (not defaults): `argv` parsed again with every default suppressed.
    (argparse keeps its actions in `_actions`; there is no public list.)"""
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(action.choices.values())
    saved = [(a, a.default) for p in parsers for a in p._actions]
    saved_defaults = [(p, p._defaults) for p in parsers]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        for p, _ in saved_defaults:
            p._defaults = {}
        given = set(vars(parser.parse_args(argv)))
    finally:
        for a, default in saved:
            a.default = default
        for p, defaults in saved_defaults:
            p._defaults = defaults
    flags = set()
    for p in parsers:
        for a in p._actions:
            if a.dest in given and a.option_strings:
                flags.add(max(a.option_strings, key=len))
    return flags


def check_conflicts(given: set[str]) -> None:
    """Refuse two options that cannot both apply (ValueError naming both flags)."""
    for flag, others, why in CONFLICTS:
        if flag in given:
            clash = [o for o in others if o in given]
            if clash:
                raise ValueError(f"{flag} and {clash[0]} cannot be used together: {why}")


def parse_with_checks(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`, then refuse conflicting options (one line, exit code 2, before any work)."""
    args = parser.parse_args(argv)
    args.given_flags = given_flags(parser, argv if argv is not None else sys.argv[1:])
    try:
        check_conflicts(args.given_flags)
    except ValueError as e:
        parser.exit(2, f"balancer {getattr(args, 'command', '')}: error: {e}\n")
    return args


def python_to_flags(message: str) -> str:
    """Library errors speak Python (`overflow='split'`, `Topology.max_tokens`); on the command line, name the flags
    (every command: the planning commands and the data commands alike)."""
    message = re.sub(r"\boverflow='(\w+)'( \([^)]*\))? or '(\w+)'", r"--overflow \1\2 or --overflow \3", message)
    message = re.sub(r"\boverflow='(\w+)'", r"--overflow \1", message)
    message = re.sub(r"\bTopology\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
    message = re.sub(r"\braise max_tokens or cp\b", "raise --max-tokens or --cp", message)
    message = message.replace("pass filler_rows=True (--filler-rows)", "pass --filler-rows")
    return re.sub(r"\blower dp or micro_batches\b", "lower --dp or --micro-batches", message)


_RUNNING: list = []  # (parser, args) of the command `main` runs: what `os_error_line` names paths by


def running(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Remember the command line being run, so that an OS error about one of its paths names the flag."""
    _RUNNING[:] = [(parser, args)]


def path_flag(filename: object) -> Optional[str]:
    """The flag (`--output`) or positional (`INPUT`) of the running command whose path is `filename` or a folder
    holding it (the most specific one), or None."""
    if not _RUNNING or not isinstance(filename, (str, bytes)) or isinstance(filename, bytes):
        return None
    import os

    parser, args = _RUNNING[0]
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    actions = sub.choices[args.command]._actions if sub is not None and args.command in sub.choices else []
    best, best_len = None, -1
    target = os.path.abspath(filename)
    for action in actions:
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if not isinstance(v, (str, os.PathLike)) or not str(v):
                continue
            path = os.path.abspath(os.fspath(v))
            if (target == path or target.startswith(path.rstrip(os.sep) + os.sep)) and len(path) > best_len:
                names = sorted(action.option_strings, key=len)
                best = names[-1] if names else (action.metavar or action.dest.upper())
                best_len = len(path)
    return best


def os_error_line(exc: OSError) -> str:
    """`describe_os_error`'s 'PATH: reason (what to do)', the path preceded by the flag that gave it."""
    from balancer.data.shards.errors import describe_os_error

    flag = path_flag(exc.filename)
    return f"{flag} {describe_os_error(exc)}" if flag else describe_os_error(exc)
