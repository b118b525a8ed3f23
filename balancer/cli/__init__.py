"""The `balancer` command: the top-level parser and `main`.

Every command lives in a module that registers its parser (`register(subparsers)`) and imports what it runs only
when it runs: cli/plan.py (demo, plan, stats), cli/data.py (pretokenize, verify, merge, pack), cli/calibrate.py,
cli/backends.py.
Options shared by the planning commands are in cli/options.py, flag ranges and one-line parse errors in cli/flags.py,
the printed reports in cli/report.py. Building the parser imports none of torch, scipy, pyarrow, datasets or
transformers (`balancer --help` starts light).
"""

from __future__ import annotations

import argparse
import io
import sys
from typing import cast

from balancer import __version__
from balancer.cli import backends as cli_backends
from balancer.cli import calibrate as cli_calibrate
from balancer.cli import data as cli_data
from balancer.cli import plan as cli_plan
from balancer.cli.flags import OneLineParser, os_error_line, parse_with_checks, python_to_flags, running


def build_parser() -> argparse.ArgumentParser:
    """The `balancer` parser with every command registered."""
    parser = OneLineParser(
        prog="balancer",
        description=(
            "Sequence-length-aware packing and DP x CP x PP scheduling: every rank gets equal work, counting "
            "attention's quadratic cost, not just tokens."
        ),
    )
    parser.add_argument("--version", action="version", version=f"balancer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_plan.register(sub)
    cli_data.register(sub)
    cli_calibrate.register(sub)
    cli_backends.register(sub)
    return parser


def _escape_undecodable_names() -> None:
    """A path that is not UTF-8 (a file name with byte 0xff) reaches messages as a surrogate escape; printed to a
    strict stream it would raise UnicodeEncodeError instead of the one-line error, so both streams escape it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            cast(io.TextIOWrapper, stream).reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):  # not a TextIOWrapper (a test's replacement): leave it
            pass


def main(argv: list[str] | None = None) -> int:
    _escape_undecodable_names()
    parser = build_parser()
    try:
        args = parse_with_checks(parser, argv)
    except SystemExit as e:  # a refused flag (one line printed), --help, --version: a code, for in-process callers
        return e.code if isinstance(e.code, int) else 2
    running(parser, args)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"balancer {args.command}: error: {python_to_flags(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"balancer {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
