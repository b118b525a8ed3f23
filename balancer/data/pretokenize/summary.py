"""What a finished `pretokenize` or `merge` run says on stderr: one summary of the folder (`summarize`), progress
lines (`log`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def _bytes(n: float) -> str:
    """A byte count in the unit that shows it (never "0.0 MB" for a small input)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def summarize(out: Path, manifest: dict, seconds: Optional[float] = None) -> None:
    """Log what a finished folder holds (counts, skipped, truncated); with `seconds`, the input rate too."""
    c = manifest["counts"]
    rate = ""
    if seconds is not None:
        size = sum(i.get("size", 0) for i in manifest["inputs"])
        rate = f", {_bytes(size)} read in {seconds:.1f} s ({_bytes(size / max(seconds, 1e-9))}/s)"
    log(
        f"{out}: {len(manifest['shards'])} shard(s), {c['documents']} documents, {c['rows']} rows, "
        f"{c['tokens']} tokens from {c['records']} records{rate}"
    )
    if c["skipped"]:
        first = manifest["skipped_records"][0] if manifest["skipped_records"] else None
        log(
            "skipped: "
            + ", ".join(f"{k}={v}" for k, v in sorted(c["skipped"].items()))
            + (f" (first: {first['where']}: {first['message']})" if first else "")
        )
    if c["truncated_documents"]:
        log(f"truncated: {c['truncated_documents']} documents lost {c['truncated_tokens']} tokens")
