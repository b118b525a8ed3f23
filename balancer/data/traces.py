"""Built-in document-length traces: every name in `NAMES` ships with the package (nothing to download or point to).

- `wlbllm` (`balancer/data/wlbllm_lengths.npz`): 99,519 lengths, max 124,913, from the public repository
  hao-ai-lab/distca (`distca/simulator/data/dist_wlbllm.json`), an approximation of the WLB-LLM training mix;
- `prolong` (`balancer/data/prolong_lengths.npz`): 77,932 lengths, max 340,149, from the same repository
  (`dist_prolong.json`), an approximation of the ProLong training mix;
- `sft`: near-uniform supervised fine-tuning mix, lengths 200..4,096;
- `heavy`: a heavy tail, 1% of documents from 128K to 1M tokens holding about 40% of the tokens, the rest
  log-normal, median 3.8K.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

RECORDED = {name: Path(__file__).parent / f"{name}_lengths.npz" for name in ("wlbllm", "prolong")}
NAMES = ("wlbllm", "prolong", "sft", "heavy")


def load_trace(name: str, n: int | None = None, seed: int = 0) -> np.ndarray:
    """Lengths of a named trace (see module docstring); `n` resamples it to n documents (generators: n docs)."""
    if name in RECORDED:
        with np.load(RECORDED[name]) as z:
            lengths = z["lengths"].astype(np.int64)
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
