"""Grids of packed micro-batches for calibration: SFT-like, long-tail and mixed length mixes at several sizes.

Every micro-batch is a list of document lengths filling a token budget exactly (the last document is cut to fit, so
budgets are met without padding). Lengths are drawn from seeded generators; nothing depends on a data set.
"""

from __future__ import annotations

import numpy as np

KINDS = ("sft", "longtail", "mixed")


def _short_docs(rng: np.random.Generator, budget: int, max_doc: int) -> list[int]:
    """Chat-turn-like documents (log-normal, median ~ budget/40, 16 tokens at least) filling `budget` tokens."""
    out, left = [], budget
    median = max(16.0, budget / 40)
    while left > 0:
        d = int(np.clip(rng.lognormal(np.log(median), 0.8), 16, max_doc))
        out.append(min(d, left))
        left -= out[-1]
    return out


def micro_batch(kind: str, budget: int, rng: np.random.Generator, max_doc: int | None = None) -> list[int]:
    """One micro-batch of `budget` tokens: `sft` (short documents only), `longtail` (one or two documents holding
    40-90% of the tokens, short ones around them) or `mixed` (a few documents of 1/8 to 1/3 of the budget among
    short ones)."""
    if kind not in KINDS:
        raise ValueError(f"micro-batch kind must be one of {KINDS}, got {kind!r}")
    if budget < 16:
        raise ValueError(f"token budget must be >= 16, got {budget}")
    max_doc = budget if max_doc is None else min(max_doc, budget)
    if kind == "sft":
        docs = _short_docs(rng, budget, max_doc)
    else:
        if kind == "longtail":
            share = rng.uniform(0.4, 0.9)
            big = [int(share * budget)] if rng.random() < 0.6 else [int(share * budget / 2)] * 2
        else:
            big = [int(rng.uniform(1 / 8, 1 / 3) * budget) for _ in range(int(rng.integers(2, 4)))]
        big = [min(max(16, b), max_doc) for b in big]
        rest = budget - sum(big)
        docs = big + (_short_docs(rng, rest, max_doc) if rest > 0 else [])
    order = rng.permutation(len(docs))
    return [int(docs[i]) for i in order]


def calibration_grid(
    budgets, kinds=KINDS, per_cell: int = 1, seed: int = 0, max_doc: int | None = None
) -> list[tuple[str, list[int]]]:
    """`per_cell` micro-batches of every (kind, budget): a list of (kind, lengths)."""
    rng = np.random.default_rng(seed)
    return [(k, micro_batch(k, int(b), rng, max_doc)) for b in budgets for k in kinds for _ in range(per_cell)]
