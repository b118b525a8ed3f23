"""What a `pretokenize` or `merge` run says on stderr: one summary of the finished folder (`summarize`), progress
lines (`log`; without a terminal, `ProgressLines` every PROGRESS_LINE_S seconds instead of a bar), byte sizes with
a readable unit (`byte_size`)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Optional

PROGRESS_LINE_S = 30.0  # seconds between progress lines when there is no terminal (and no bar)


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def summarize(out: Path, manifest: dict, seconds: Optional[float] = None) -> None:
    """Log what a finished folder holds (counts, skipped, truncated); with `seconds`, the input and token rates."""
    c = manifest["counts"]
    rate = ""
    if seconds is not None:
        size = sum(i.get("size", 0) for i in manifest["inputs"])
        per_s = max(seconds, 1e-9)
        rate = (
            f", {byte_size(size)} read in {seconds:.1f} s "
            f"({byte_size(size / per_s)}/s, {c['tokens'] / per_s:,.0f} tokens/s)"
        )
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


def byte_size(n: float) -> str:
    """`n` bytes with a unit that keeps 3 significant digits: 512 B, 41.2 kB, 3.07 MB, 1.25 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


class ProgressLines:
    """Without a terminal (no bar) and unless quiet: a progress line every PROGRESS_LINE_S seconds from a timer
    thread, also while no batch arrives, so a log shows a long run is alive (Ray can take a minute to start its
    workers); a run shorter than that prints none (its errors stay one line)."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.total, self.done, self.documents = total, initial, 0
        self.started = time.perf_counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="pretokenize-progress", daemon=True)
        if enabled:
            self.thread.start()

    def _tick(self) -> None:
        while not self.stopped.wait(PROGRESS_LINE_S):
            share = self.done / self.total if self.total else 1.0
            log(
                f"pretokenize: {byte_size(self.done)} of {byte_size(self.total)} read ({share:.0%}), "
                f"{self.documents:,} documents, {time.perf_counter() - self.started:.0f} s"
            )

    def close(self) -> None:
        """Stop the timer and wait for a line it may be printing, so no line comes after the run's summary."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
