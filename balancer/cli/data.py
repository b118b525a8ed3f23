"""Data subcommands of the `balancer` command: `pretokenize`, `verify`, `merge`.

`register(subparsers)` adds them to an argparse subparsers object; each sets `func(args) -> exit code`.
`python -m balancer.cli_data ...` runs them without the main `balancer` command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

EXIT_OK = 0
EXIT_PROBLEM = 1  # verify found problems
EXIT_ERROR = 2  # bad input, refused output folder, bad options


def _positive_int(text: str) -> int:
    try:
        v = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _run_pretokenize(args: argparse.Namespace) -> int:
    from ..data.shards import PretokenizeError, PretokenizeOptions, pretokenize

    opts = PretokenizeOptions(
        text_field=args.text_field,
        max_length=args.max_length,
        overflow=args.overflow,
        add_eos=args.add_eos,
        on_error=args.on_error,
        shard_tokens=args.shard_tokens,
    )
    if (args.num_shards is None) != (args.shard_index is None):
        print("error: --num-shards and --shard-index go together", file=sys.stderr)
        return EXIT_ERROR
    if args.ray_address is not None and args.engine != "ray":
        print("error: --ray-address needs --engine ray", file=sys.stderr)
        return EXIT_ERROR
    try:
        pretokenize(
            args.inputs,
            args.output,
            tokenizer=args.tokenizer,
            options=opts,
            num_proc=args.num_proc,
            num_shards=args.num_shards or 1,
            shard_index=args.shard_index or 0,
            overwrite=args.overwrite,
            progress=False if args.quiet else None,
            engine=args.engine,
            ray_address=args.ray_address,
        )
    except PretokenizeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return EXIT_OK


def _run_verify(args: argparse.Namespace) -> int:
    from ..data.shards import load_manifest, verify

    problems = verify(args.dir)
    if problems:
        for p in problems:
            print(f"FAIL {p}", file=sys.stderr)
        print(f"{args.dir}: {len(problems)} problem(s)", file=sys.stderr)
        return EXIT_PROBLEM
    c = load_manifest(args.dir)["counts"]
    print(f"OK {args.dir}: {c['rows']} rows, {c['tokens']} tokens, {c['documents']} documents verified")
    return EXIT_OK


def _run_merge(args: argparse.Namespace) -> int:
    from ..data.shards import PretokenizeError, merge

    try:
        merge(args.parts, args.output, overwrite=args.overwrite)
    except PretokenizeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def register(subparsers) -> None:
    """Add `pretokenize`, `verify` and `merge` to an argparse subparsers object."""
    from ..data.shards import DEFAULT_SHARD_TOKENS

    p = subparsers.add_parser(
        "pretokenize",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="tokenize raw corpora into memory-mappable shards with a lengths index and a manifest",
        description="Tokenize INPUTs into Arrow shards under --output (rows: input_ids, doc_id), with a lengths "
        "index per shard and manifest.json written last.\nA killed run resumes when started again "
        "with the same command; the output is byte-identical to an uninterrupted run.",
        epilog="examples:\n"
        "  balancer pretokenize corpus.jsonl --output tok/\n"
        "  balancer pretokenize data/ --tokenizer ./my_tokenizer --max-length 32768 --add-eos "
        "--num-proc 8 --output tok/\n"
        "  balancer pretokenize big.jsonl --num-shards 4 --shard-index 0 --output part0/  "
        "# then: balancer merge part0 part1 part2 part3 --output tok/\n"
        "  balancer pretokenize /shared/corpus/ --engine ray --ray-address head:6379 --output /shared/tok/",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".jsonl/.json (JSON lines or an array of objects), .parquet, .txt (one document per file), the "
        "JSON and .txt files also gzip/zstd compressed (.jsonl.gz, .json.zst, .txt.gz, ...), "
        "directories of them (sorted by path), or a Hugging Face dataset folder (save_to_disk) or "
        "hub name (its 'train' split; needs the network)",
    )
    p.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="DIR",
        help="output folder; refused when it holds a different job or other files, unless --overwrite",
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|PATH_OR_NAME",
        help="'byte' (default): ids are the UTF-8 bytes, vocab 257 with EOS id 256; otherwise a "
        "transformers.AutoTokenizer folder or name (a local folder works offline)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="field/column holding the text in JSON, parquet and dataset inputs (default: text)",
    )
    p.add_argument(
        "--max-length",
        type=_positive_int,
        default=None,
        metavar="N",
        help="longest row in tokens; longer documents are handled by --overflow (default: no limit)",
    )
    p.add_argument(
        "--overflow",
        choices=("split", "truncate", "drop"),
        default="split",
        help="documents over --max-length: split into consecutive windows of at most N tokens sharing "
        "the doc_id (default), truncate to the first N tokens (counted in the manifest), or drop "
        "(counted as skipped 'too_long')",
    )
    p.add_argument(
        "--add-eos",
        action="store_true",
        help="append the tokenizer's EOS id to every document (before --max-length is applied)",
    )
    p.add_argument(
        "--num-proc",
        type=_positive_int,
        default=1,
        metavar="N",
        help="tokenize in N worker processes, with --engine ray N tasks at a time (output identical to N=1; default 1)",
    )
    p.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="malformed records (bad JSON, missing text field, invalid UTF-8): fail at the first one "
        "naming file and line (default), or skip them and count them by reason in the manifest",
    )
    p.add_argument(
        "--shard-tokens",
        type=_positive_int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"close a shard at the first document boundary after N tokens (default {DEFAULT_SHARD_TOKENS:,})",
    )
    p.add_argument(
        "--num-shards",
        type=_positive_int,
        default=None,
        metavar="K",
        help="process only slice --shard-index of K equal record ranges of the inputs (with --shard-index); "
        "join the K outputs with `balancer merge`",
    )
    p.add_argument(
        "--shard-index",
        type=_nonneg_int,
        default=None,
        metavar="I",
        help="which slice (0..K-1) of --num-shards to process",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a different job's output in --output (its shard files and manifest are deleted)",
    )
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local (default): this machine, --num-proc processes; ray: Ray Data tasks (a local Ray cluster, "
        "or the one at --ray-address; needs the ray extra). Same output either way",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --engine ray: the cluster to run on (HOST:PORT, ray://HOST:PORT or auto); its nodes must see "
        "INPUTs and --output at the same paths (a shared filesystem). Default: start a local cluster",
    )
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress bar and no summary (errors are still printed); bars show only on a terminal anyway",
    )
    p.set_defaults(func=_run_pretokenize)

    v = subparsers.add_parser(
        "verify",
        help="check a pretokenized folder (checksums, counts, lengths index)",
        description="Check every file's sha256 and size against manifest.json, row and token "
        "counts, and the lengths/doc_id index against the Arrow data. Exit 0 "
        "when all is well, 1 naming each problem.",
    )
    v.add_argument("dir", metavar="DIR", help="a folder written by `balancer pretokenize` or `balancer merge`")
    v.set_defaults(func=_run_verify)

    m = subparsers.add_parser(
        "merge",
        help="join the outputs of --num-shards/--shard-index runs into one folder",
        description="Join the K outputs of `pretokenize --num-shards K --shard-index i` runs "
        "(any order) into --output: same rows as one run over all inputs. Files "
        "are hard-linked when on the same filesystem, else copied; checksums "
        "are checked.",
    )
    m.add_argument("parts", nargs="+", metavar="PART_DIR", help="the K slice output folders")
    m.add_argument("--output", "-o", required=True, metavar="DIR", help="merged output folder")
    m.add_argument("--overwrite", action="store_true", help="replace a different job's output in --output")
    m.set_defaults(func=_run_merge)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m balancer.cli_data {pretokenize,verify,merge} ...`"""
    parser = argparse.ArgumentParser(prog="balancer", description="balancer data commands")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
