"""Kill-and-relaunch runs of the restart examples under torchrun, for the restart tests: a first launch on N
processes that a killed worker stops, a relaunch on M from the last checkpoint, and what every rank traced (one
JSON line per step, each naming its `world`); the tokens the traced steps trained, per document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def launch(script: str, nproc: int, *args: str, timeout: float = 420) -> tuple[int, str]:
    """Run `examples/<script>` under torchrun (standalone, no elastic restart) on `nproc` processes over gloo on
    the loopback: (exit code, the end of its output)."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
           str(ROOT / "examples" / script), *args]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, (out.stdout + out.stderr)[-4000:]


def read_trace(folder: Path) -> list[dict]:
    """Every JSON line of every `*.jsonl` file in `folder` (files in name order)."""
    return [json.loads(x) for f in sorted(folder.glob("*.jsonl")) for x in f.read_text().splitlines() if x.strip()]


def kill_then_relaunch(
    script: str,
    trace: Path,
    first: tuple[int, list[str]],
    second: tuple[int, list[str]],
    between: Callable[[str], None] = lambda tail: None,
) -> tuple[list[dict], list[dict]]:
    """Launch `script` on `first[0]` processes with arguments `first[1]` (the job must stop: a worker killed), call
    `between(output tail)`, launch it again on `second[0]` with `second[1]` (it must finish); the traced lines of
    each launch, told apart by their `world` (every traced line belongs to one of the two)."""
    code, tail = launch(script, first[0], *first[1])
    assert code != 0, f"the first launch did not stop: {tail}"
    between(tail)
    code, tail = launch(script, second[0], *second[1])
    assert code == 0, tail
    lines = read_trace(trace)
    before = [r for r in lines if r["world"] == first[0]]
    after = [r for r in lines if r["world"] == second[0]]
    assert before and after and len(before) + len(after) == len(lines), (len(before), len(after), len(lines))
    return before, after


def token_coverage(pieces: Iterable, lengths: np.ndarray) -> np.ndarray:
    """How many times each token of the corpus (documents concatenated) is in `pieces`: each piece a `Span`, a
    document index, or its JSON form `[doc]` / `[doc, start, end]`."""
    offset = np.concatenate([[0], np.cumsum(lengths)])
    seen = np.zeros(int(offset[-1]), dtype=np.int64)
    for p in pieces:
        if hasattr(p, "doc"):
            d, a, b = p.doc, p.start, p.end
        elif isinstance(p, (list, tuple)):
            d, a, b = (p[0], 0, int(lengths[p[0]])) if len(p) == 1 else p
        else:
            d, a, b = int(p), 0, int(lengths[int(p)])
        seen[offset[d] + a : offset[d] + b] += 1
    return seen
