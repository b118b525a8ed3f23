"""Document-length traces: the built-in one, the published ones in shared/, and generated distributions.

- `wlbllm` (built in, `balancer/data/wlbllm_lengths.npz`): 99,519 lengths, max 124,913, from the public repository
  hao-ai-lab/distca (`distca/simulator/data/dist_wlbllm.json`), an approximation of the WLB-LLM training mix;
- `prolong`: read from `shared/data/length_traces/prolong.json` when that folder is present;
- `sft`: near-uniform supervised fine-tuning mix, lengths 200..4,096;
- `heavy`: a heavy tail, 1% of documents from 128K to 1M tokens holding about 40% of the tokens, the rest
  log-normal, median 3.8K.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

BUILTIN = Path(__file__).parent / "wlbllm_lengths.npz"
NAMES = ("wlbllm", "prolong", "sft", "heavy")


def _shared_dir() -> Path | None:
    env = os.environ.get("BALANCER_TRACES")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "data" / "length_traces" for p in here.parents]
    for c in candidates:
        if c.is_dir():
            return c
    return None


def load_trace(name: str, n: int | None = None, seed: int = 0) -> np.ndarray:
    """Lengths of a named trace (see module docstring); `n` resamples it to n documents (generators: n docs)."""
    if name == "wlbllm":
        with np.load(BUILTIN) as z:
            lengths = z["lengths"].astype(np.int64)
    elif name == "prolong":
        d = _shared_dir()
        if d is None or not (d / "prolong.json").exists():
            raise FileNotFoundError(
                "the prolong trace is read from shared/data/length_traces/prolong.json "
                "(set BALANCER_TRACES to its folder)"
            )
        lengths = np.asarray(json.loads((d / "prolong.json").read_text()), dtype=np.int64)
    elif name == "sft":
        return sft_mix(n or 100_000, seed)
    elif name == "heavy":
        return heavy_tail(n or 100_000, seed)
    else:
        raise ValueError(f"unknown trace {name!r}; choose one of {NAMES} or pass a file")
    if n is not None and n != len(lengths):
        lengths = np.random.default_rng(seed).choice(lengths, n)
    return lengths


def sft_mix(n: int, seed: int = 0) -> np.ndarray:
    """Near-uniform SFT lengths in [200, 4096]."""
    return np.random.default_rng(seed).integers(200, 4097, n).astype(np.int64)


def heavy_tail(n: int, seed: int = 0, tail_share: float = 0.01, lo: int = 131072, hi: int = 1048576) -> np.ndarray:
    """1% of documents log-uniform in [128K, 1M] (about 40% of the tokens); the rest log-normal, median 3.8K."""
    rng = np.random.default_rng(seed)
    body = np.clip(rng.lognormal(np.log(3800), 1.0, n), 16, lo - 1).astype(np.int64)
    tail = rng.random(n) < tail_share
    body[tail] = np.exp(rng.uniform(np.log(lo), np.log(hi), int(tail.sum()))).astype(np.int64)
    return body
