"""Data subcommands of the `balancer` command: `pretokenize`, `verify`, `merge`, `pack`.

`register(subparsers)` adds them to an argparse subparsers object; each sets `func(args) -> exit code`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from balancer.cli.flags import count, limits, os_error_line, python_to_flags
from balancer.cli.options import add_topology_args, cost_from_args, topology_from_args
from balancer.data.pretokenize.options import ENGINES, ON_ERROR_CHOICES, OVERFLOW_CHOICES
from balancer.data.shards.errors import describe_os_error, render_message
from balancer.limits import DEFAULT_SHARD_TOKENS, MAX_EPOCHS, MAX_LENGTH, MAX_NUM_PROC, MAX_NUM_SHARDS, MAX_SHARD_TOKENS
from balancer.planning.units import OVERFLOW_POLICIES

EXIT_OK = 0
EXIT_PROBLEM = 1  # verify found problems
EXIT_ERROR = 2  # bad input, refused output folder, bad options
# argparse checks the lowest value; the commands check the highest (their API names the argument, the CLI the flag)
POSITIVE, NONNEGATIVE = count(1, None), count(0, None)


# Python argument names of pretokenize/merge/pack (and the topology they plan for) -> the flags of these commands:
# the API raises with argument names, and the CLI shows the same message with its flags.
FLAGS = {
    "inputs": "INPUT",
    "parts": "PART_DIR",
    "source": "TOKDIR",
    "output": "--output",
    "tokenizer": "--tokenizer",
    "text_field": "--text-field",
    "max_length": "--max-length",
    "overflow": "--overflow",
    "add_eos": "--add-eos",
    "num_proc": "--num-proc",
    "on_error": "--on-error",
    "shard_tokens": "--shard-tokens",
    "num_shards": "--num-shards",
    "shard_index": "--shard-index",
    "overwrite": "--overwrite",
    "engine": "--engine",
    "ray_address": "--ray-address",
    "epochs": "--epochs",
    "seed": "--seed",
    "max_tokens": "--max-tokens",
    "dp": "--dp",
    "pp": "--pp",
    "micro_batches": "--micro-batches",
    "tokens_per_step": "--tokens-per-step",
    "cp": "--cp",
    "cp_sizes": "--cp-sizes",
}


def cli_message(exc: BaseException) -> str:
    """The message of a data error with the CLI's flags where it names an option."""
    raw = getattr(exc, "raw_message", None)
    return python_to_flags(render_message(raw, FLAGS) if raw is not None else str(exc))


def _reporting(call, errors: tuple, resumable: bool) -> int:
    """Run a data job: ``errors`` (and, for every job, OS errors) become one ``error:`` line and EXIT_ERROR; Ctrl-C
    on a ``resumable`` job says how to resume."""
    try:
        call()
    except errors as exc:
        print(f"error: {cli_message(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"error: {os_error_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if not resumable:
            raise
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return EXIT_OK


def _run_pretokenize(args: argparse.Namespace) -> int:
    from balancer.data.pretokenize.options import PretokenizeOptions
    from balancer.data.pretokenize.pipeline import pretokenize
    from balancer.data.shards.errors import DataError

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
    return _reporting(
        lambda: pretokenize(
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
        ),
        (DataError,),
        resumable=True,
    )


def _path(value: str) -> str:
    """A path argument: an empty one is refused (it would mean the current folder)."""
    if not value:
        raise argparse.ArgumentTypeError("an empty path; give a folder name")
    return value


def _run_verify(args: argparse.Namespace) -> int:
    from balancer.data.pack.verify import is_packed, load_packed_manifest, verify_packed
    from balancer.data.shards.manifest import load_manifest
    from balancer.data.shards.verify import verify

    if not os.path.isdir(args.dir):  # bad input (exit 2), not a folder that fails verification (exit 1)
        what = (
            "a broken symbolic link"
            if os.path.islink(args.dir)
            else "not a folder"
            if os.path.lexists(args.dir)
            else "no such folder"
        )
        print(f"error: DIR {args.dir}: {what} (give a folder written by pretokenize, merge or pack)", file=sys.stderr)
        return EXIT_ERROR
    try:
        packed = is_packed(args.dir)
        problems = verify_packed(args.dir) if packed else verify(args.dir)
    except OSError as exc:
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_ERROR
    if problems:
        for p in problems:
            print(f"FAIL {p}", file=sys.stderr)
        print(f"{args.dir}: {len(problems)} problem(s)", file=sys.stderr)
        return EXIT_PROBLEM
    if packed:
        c = load_packed_manifest(args.dir)["counts"]
        print(f"OK {args.dir}: {c['rows']} packed rows, {c['tokens']} tokens verified against the plans")
    else:
        c = load_manifest(args.dir)["counts"]
        print(f"OK {args.dir}: {c['rows']} rows, {c['tokens']} tokens, {c['documents']} documents verified")
    return EXIT_OK


def _run_merge(args: argparse.Namespace) -> int:
    from balancer.data.pretokenize.merge import merge
    from balancer.data.shards.errors import DataError

    return _reporting(lambda: merge(args.parts, args.output, overwrite=args.overwrite), (DataError,), False)


def _run_pack(args: argparse.Namespace) -> int:
    from balancer.data.pack.build import pack
    from balancer.data.pack.rows import SourceTokens
    from balancer.data.shards.errors import DataError

    done: dict = {}

    def run() -> None:
        with SourceTokens(args.tokdir) as source:
            done["manifest"] = pack(
                source,
                args.output,
                topology_from_args(args, source.lengths),
                cost_from_args(args),
                epochs=args.epochs,
                seed=args.seed,
                overflow=args.overflow,
                shard_tokens=args.shard_tokens,
                overwrite=args.overwrite,
                progress=False if args.quiet else None,
            )

    code = _reporting(run, (DataError, ValueError), resumable=True)  # PackError is a DataError
    if code == EXIT_OK:
        print(pack_balance_report(done["manifest"]))
    return code


def pack_balance_report(manifest: dict) -> str:
    """The balance figures of every packed epoch (the metrics its manifest.json records), as a table."""
    from balancer.cli.report import metrics_table

    epochs = {f"epoch {e['epoch']}": e["metrics"] for e in manifest["epochs"]}
    return f"balance of the packed rows (manifest.json: epochs[].metrics)\n{metrics_table(epochs, timed=False)}"


def register(subparsers: Any) -> None:
    """Add `pretokenize`, `verify`, `merge` and `pack` to an argparse subparsers object."""
    _register_pretokenize(subparsers)
    _register_verify_and_merge(subparsers)
    _register_pack(subparsers)


def _register_pretokenize(subparsers) -> None:
    p = subparsers.add_parser(
        "pretokenize",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="tokenize raw corpora into memory-mappable shards with a lengths index and a manifest",
        description="Tokenize INPUTs into Arrow shards under --output (rows: input_ids, doc_id), with a lengths "
        "index per shard and manifest.json written last.\nA killed run resumes when started again "
        "with the same command; the output is byte-identical to an uninterrupted run.\nOne run at a time writes "
        "a folder: a second one fails naming DIR/.balancer.lock and the run holding it.",
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
        type=_path,
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
        type=_path,
        metavar="DIR",
        help="output folder; refused when it holds a different job or other files, unless --overwrite",
    )
    _add_pretokenize_job_args(p)
    _add_pretokenize_run_args(p)
    p.set_defaults(func=_run_pretokenize)


def _add_pretokenize_job_args(p: argparse.ArgumentParser) -> None:
    """The options that decide the output bytes (`PretokenizeOptions`)."""
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
        type=POSITIVE,
        default=None,
        metavar="N",
        help=f"longest row in tokens, {limits(1, MAX_LENGTH)}; longer documents are handled by --overflow "
        "(default: no limit)",
    )
    p.add_argument(
        "--overflow",
        choices=OVERFLOW_CHOICES,
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
        "--on-error",
        choices=ON_ERROR_CHOICES,
        default="fail",
        help="malformed records (bad JSON, missing text field, invalid UTF-8): fail at the first one "
        "naming file and line (default), or skip them and count them by reason in the manifest",
    )
    p.add_argument(
        "--shard-tokens",
        type=POSITIVE,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"close a shard at the first document boundary after N tokens ({limits(1, MAX_SHARD_TOKENS)}; default "
        f"{DEFAULT_SHARD_TOKENS:,})",
    )


def _add_pretokenize_run_args(p: argparse.ArgumentParser) -> None:
    """How the run goes: processes, slices, engine, output replacement, progress."""
    p.add_argument(
        "--num-proc",
        type=POSITIVE,
        default=1,
        metavar="N",
        help=f"tokenize in N worker processes ({limits(1, MAX_NUM_PROC)}; clipped to the CPUs and the records, with a "
        "note), with "
        "--engine ray N tasks at a time (output identical to N=1; default 1)",
    )
    p.add_argument(
        "--num-shards",
        type=POSITIVE,
        default=None,
        metavar="K",
        help=f"process only slice --shard-index of K ({limits(1, MAX_NUM_SHARDS)}) equal record ranges of the inputs; "
        "join the K outputs with `balancer merge`",
    )
    p.add_argument(
        "--shard-index",
        type=NONNEGATIVE,
        default=None,
        metavar="I",
        help="which slice (0..K-1) of --num-shards to process",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a different job's output in --output: deletes only the files this tool wrote there (named "
        "by its manifest or state file), never your files or an input; a file of yours with one of our names "
        "(manifest.json, state.json, ...) is refused, not deleted",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
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
        help="no progress bars (they show only on a terminal anyway); the final summary line is still printed",
    )


def _register_verify_and_merge(subparsers) -> None:
    v = subparsers.add_parser(
        "verify",
        help="check a pretokenized folder (checksums, counts, lengths index)",
        description="Check every file's sha256 and size against manifest.json, row and token "
        "counts, and the lengths/doc_id index against the Arrow data; every name in the manifest must stay "
        "inside DIR. Exit 0 when all is well, 1 naming each problem. (Opening a folder with ShardDataset or "
        "read_lengths runs the cheap part of these checks every time.)",
    )
    v.add_argument(
        "dir", type=_path, metavar="DIR", help="a folder written by `balancer pretokenize`, `merge` or `pack`"
    )
    v.set_defaults(func=_run_verify)

    m = subparsers.add_parser(
        "merge",
        help="join the outputs of --num-shards/--shard-index runs into one folder",
        description="Join the K outputs of `pretokenize --num-shards K --shard-index i` runs "
        "(any order) into --output: same rows as one run over all inputs. Files "
        "are hard-linked when on the same filesystem, else copied; checksums "
        "are checked.",
    )
    m.add_argument("parts", nargs="+", type=_path, metavar="PART_DIR", help="the K slice output folders")
    m.add_argument("--output", "-o", required=True, type=_path, metavar="DIR", help="merged output folder")
    m.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a different job's output in --output (deletes only the files this tool wrote there)",
    )
    m.set_defaults(func=_run_merge)


def _register_pack(subparsers) -> None:
    p = subparsers.add_parser(
        "pack",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="plan epochs of a pretokenized folder and write balanced, pre-packed rows for any loader",
        description="Plan --epochs epochs of TOKDIR (a `balancer pretokenize` output) for a topology (epoch e\n"
        "with seed --seed + e) and write a `datasets` folder with one row per (epoch, step, micro-batch, DP rank),\n"
        "in that order: row i belongs to DP rank i % dp, so DistributedSampler(num_replicas=dp, rank=dp_rank,\n"
        "shuffle=False) gives every replica its plan. A row is one whole micro-batch; columns: input_ids,\n"
        "position_ids (from 0 for every piece), seq_lens, doc_ids (rows of TOKDIR), doc_starts, epoch, step,\n"
        "micro_batch, dp_rank. The plans are written beside the rows (plan-epoch-NNNNN.json), manifest.json last.\n"
        "A killed run resumes when started again with the same command; the output is byte-identical to an\n"
        "uninterrupted run. `balancer verify DIR` checks every row against its plan.",
        epilog="examples:\n"
        "  balancer pack tok/ --output packed/ --dp 8 --cp 2 --micro-batches 4 --max-tokens 32768 --epochs 3\n"
        "  balancer pack tok/ --output packed/ --dp 4 --max-tokens 8192 --overflow split --model llama3-8b\n"
        "  balancer verify packed/",
    )
    p.add_argument(
        "tokdir", type=_path, metavar="TOKDIR", help="a folder written by `balancer pretokenize` (or `merge`)"
    )
    p.add_argument(
        "--output",
        "-o",
        required=True,
        type=_path,
        metavar="DIR",
        help="output folder; refused when it holds a different job or other files, unless --overwrite",
    )
    add_topology_args(p)
    p.add_argument(
        "--cp-sizes",
        metavar="SIZES",
        help="dynamic CP (as for `balancer plan`) is refused: its micro-batch slots regroup the ranks, which rows "
        "per DP rank cannot express; train from a plan with BalancedBatchSampler instead",
    )
    p.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default="error",
        help="rows of TOKDIR longer than max_tokens*cp: error (default), split into windows placed in several "
        "micro-batches, or truncate (the rest is counted as dropped in the manifest)",
    )
    p.add_argument(
        "--epochs",
        type=POSITIVE,
        default=1,
        metavar="E",
        help=f"epochs to plan and write, {limits(1, MAX_EPOCHS)} (default 1)",
    )
    p.add_argument(
        "--shard-tokens",
        type=POSITIVE,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"close a shard at the first row boundary after N tokens ({limits(1, MAX_SHARD_TOKENS)}; default "
        f"{DEFAULT_SHARD_TOKENS:,})",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a different job's output in --output (its shard, plan and manifest files are deleted)",
    )
    p.set_defaults(func=_run_pack)
