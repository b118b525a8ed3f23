"""What do the open-time checks of a pretokenized folder cost, against one full read of the folder?

Question: `ShardDataset(DIR)` / `read_lengths(DIR)` check the manifest, the sha256 of every lengths/doc_id index
file and each Arrow file's row count (from its message headers) on every open. How much is that, cold (page cache
dropped) and warm, as a share of reading every byte of the folder once (the cheapest possible full pass; `verify`,
which also hashes every byte, is timed beside it)? "unchecked_open" is what an open cost before the checks (the
manifest and the index files loaded, nothing compared): any reader pays it, the checks add the difference.

Corpus: JSON lines of random lowercase text, tokenized by `balancer pretokenize` with the byte tokenizer (one token
per byte, uint16 on disk). "long": document lengths drawn from the WLB-LLM trace (mean ~4K tokens); "short": 32..512
tokens (SFT-like), the expensive case for the checks, whose cost grows with rows, not bytes.

    python benchmarks/open_checks.py                 # ~4 GB + ~0.5 GB corpora under /tmp/open_checks (deleted after)
    python benchmarks/open_checks.py --gb 1 --short-gb 0.2 --repeat 2

Writes benchmarks/results/open_checks.json. Cold figures need root (`echo 3 > /proc/sys/vm/drop_caches`); without
it they are recorded as null with the reason. Times are the minimum over --repeat runs (the machine may be shared);
the record holds both clocks (wall and process CPU), the cores and the load at start and end.

Extrapolation: the open checks read the index files (16 bytes per row, CRC-32) and one message header per Arrow
record batch (<= 64K rows or 16M tokens); a full read reads every byte. Both grow linearly with the corpus at a fixed
mean row length, so the share measured holds for a larger corpus of the same rows; it grows as rows get shorter
(index bytes / token bytes = 8 / mean row tokens for uint16 ids).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _render as tb

from balancer.data.pretokenize.options import PretokenizeOptions  # noqa: E402
from balancer.data.pretokenize.pipeline import pretokenize  # noqa: E402
from balancer.data.shards.checks import open_folder  # noqa: E402
from balancer.data.shards.dataset import ShardDataset
from balancer.data.shards.manifest import load_manifest
from balancer.data.shards.verify import verify
from balancer.data.traces import load_trace  # noqa: E402
from benchmarks._common import write_result  # noqa: E402

LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


def write_corpus(path: Path, lengths: np.ndarray, seed: int) -> int:
    """One JSON line per document of random ASCII text of the given byte lengths; returns bytes of text."""
    rng = np.random.default_rng(seed)
    total = 0
    with open(path, "w", encoding="ascii") as f:
        for start in range(0, len(lengths), 4096):
            chunk = lengths[start : start + 4096]
            text = LETTERS[rng.integers(0, len(LETTERS), int(chunk.sum()))].tobytes().decode("ascii")
            pos = 0
            for n in chunk:
                f.write('{"text": "' + text[pos : pos + n] + '"}\n')
                pos += n
            total += int(chunk.sum())
    return total


def lengths_for(kind: str, target_bytes: float, seed: int) -> np.ndarray:
    """Document lengths (tokens = bytes) until the tokenized output (2 bytes per token) reaches target_bytes."""
    rng = np.random.default_rng(seed)
    tokens = int(target_bytes / 2)
    if kind == "long":
        trace = load_trace("wlbllm")
        n = int(tokens / trace.mean()) + 1
        return rng.choice(trace, size=n).astype(np.int64)
    n = int(tokens / 272) + 1
    return rng.integers(32, 513, size=n).astype(np.int64)


def drop_caches() -> str | None:
    """None when the page cache was dropped, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return f"cannot drop the page cache: {exc.strerror} (needs root)"


def full_read(folder: Path) -> int:
    """Read every byte of every file once, sequentially, in 8 MiB chunks (the cheapest full pass)."""
    total = 0
    for p in sorted(folder.iterdir()):
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return total


def timed(fn, cold: bool) -> tuple[float, float] | None:
    """(wall seconds, CPU seconds of this process: user + system) of one call; None when cold is impossible."""
    if cold and drop_caches() is not None:
        return None
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def unchecked_open(folder: Path) -> None:
    """What opening cost before the checks: the manifest and every index file loaded, nothing compared."""
    m = load_manifest(folder)
    for entry in m["shards"]:
        np.load(folder / f"{entry['name']}.lengths.npy")
        np.load(folder / f"{entry['name']}.doc_ids.npy")


def measure(folder: Path, repeat: int, with_verify: bool) -> dict:
    """Best (minimum) wall and CPU seconds per operation, cold and warm, and the shares of a full read. Wall time
    on a shared machine is noisy; CPU time (user + system, the kernel's copies included) much less so."""
    ops = {
        "unchecked_open": lambda: unchecked_open(folder),
        "open_checks": lambda: open_folder(folder),
        "shard_dataset_open": lambda: ShardDataset(folder),
        "full_read": lambda: full_read(folder),
    }
    if with_verify:
        ops["verify"] = lambda: verify(folder)
    out: dict = {}
    for mode in ("cold", "warm"):
        runs: dict[str, list] = {k: [] for k in ops}
        for _ in range(repeat):
            for name, fn in ops.items():
                if mode == "warm":
                    fn()  # bring it into the page cache first
                runs[name].append(timed(fn, cold=mode == "cold"))
        if any(r is None for v in runs.values() for r in v):
            out[mode] = None
            continue
        figures: dict = {"runs_wall_cpu": runs}
        for clock, i in (("wall", 0), ("cpu", 1)):
            best = {k: min(r[i] for r in v) for k, v in runs.items()}
            figures[clock] = {
                **best,
                "open_checks_share_of_full_read": best["open_checks"] / best["full_read"],
                "checks_added_share_of_full_read": (best["open_checks"] - best["unchecked_open"]) / best["full_read"],
                "shard_dataset_open_share_of_full_read": best["shard_dataset_open"] / best["full_read"],
            }
            if with_verify:
                figures[clock]["open_checks_share_of_verify"] = best["open_checks"] / best["verify"]
        out[mode] = figures
    return out


def corpus_facts(folder: Path) -> dict:
    m = load_manifest(folder)
    files = sorted(folder.iterdir())
    index_bytes = sum(p.stat().st_size for p in files if p.name.endswith(".npy"))
    total = sum(p.stat().st_size for p in files)
    return {
        "bytes": total,
        "shards": len(m["shards"]),
        "rows": m["counts"]["rows"],
        "tokens": m["counts"]["tokens"],
        "mean_row_tokens": m["counts"]["tokens"] / max(1, m["counts"]["rows"]),
        "index_bytes": index_bytes,
        "index_share_of_bytes": index_bytes / total,
    }


def build(work: Path, kind: str, gb: float, seed: int) -> tuple[Path, float]:
    src = work / f"{kind}.jsonl"
    write_corpus(src, lengths_for(kind, gb * 1e9, seed), seed)
    out = work / f"{kind}_tok"
    t0 = time.perf_counter()
    pretokenize([str(src)], out, options=PretokenizeOptions(), progress=False)
    seconds = time.perf_counter() - t0
    os.remove(src)
    return out, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="size of the long-document folder in GB (default 4)")
    ap.add_argument("--short-gb", type=float, default=0.5, help="size of the short-row folder (default 0.5)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per figure, the minimum is kept (default 5)")
    ap.add_argument("--workdir", default="/tmp/open_checks", help="scratch folder (deleted afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the corpora")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    df = subprocess.run(["df", "-h", str(work)], capture_output=True, text=True).stdout
    result: dict = {"repeat": args.repeat, "df": df, "cold_unavailable": drop_caches(), "corpora": {}}
    try:
        for kind, gb, with_verify in (("long", args.gb, True), ("short", args.short_gb, False)):
            folder, build_s = build(work, kind, gb, seed=1)
            facts = corpus_facts(folder)
            print(f"{kind}: {facts['bytes'] / 1e9:.2f} GB, {facts['rows']} rows, built in {build_s:.0f} s", flush=True)
            figures = measure(folder, args.repeat, with_verify)
            result["corpora"][kind] = {**facts, "build_seconds": build_s, **figures}
            for mode in ("cold", "warm"):
                for clock in ("wall", "cpu"):
                    fig = (figures[mode] or {}).get(clock, {})
                    print(
                        f"  {mode} {clock}: open {fig.get('open_checks')}, full read {fig.get('full_read')}, "
                        f"share {fig.get('open_checks_share_of_full_read')}",
                        flush=True,
                    )
            if not args.keep:
                shutil.rmtree(folder)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(write_result("open_checks", result, clock="wall+process_cpu"))


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_open_checks() -> str:
    data = tb.load("open_checks")
    rows = []
    for name, corpus in data["corpora"].items():
        for cache in ("cold", "warm"):
            result = corpus.get(cache)
            if not result:
                continue
            rows.append(
                [
                    f"{name} ({corpus['bytes'] / 1e9:.2f} GB, {corpus['rows']:,} rows, "
                    f"mean {corpus['mean_row_tokens']:.0f} tokens/row)",
                    cache,
                    tb.fmt(result["wall"]["open_checks_share_of_full_read"], ".1%"),
                    tb.fmt(result["cpu"]["open_checks_share_of_full_read"], ".1%"),
                    tb.fmt(result["wall"]["checks_added_share_of_full_read"], ".1%"),
                    tb.fmt(result["wall"].get("open_checks_share_of_verify"), ".2%"),
                ]
            )
    header = ["corpus", "page cache", "open / full read (wall)", "open / full read (CPU)"]
    header += ["checks alone / full read (wall)", "open / verify (wall)"]
    cold = f"\n\nCold runs: {data['cold_unavailable']}." if data.get("cold_unavailable") else ""
    return tb.markdown(header, rows) + cold + tb.record_line(data)[:-1] + f"; {tb.commit_note(data)}."


TABLES = {  # docs/ marker name -> the table, from the record
    "open_checks": table_open_checks,
}


if __name__ == "__main__":
    main()
