"""Grids of packed micro-batches for calibration: SFT-like, long-tail and mixed length mixes at several sizes.

Every micro-batch is a list of document lengths filling a token budget exactly (the last document is cut to fit, so
budgets are met without padding). Lengths are drawn from seeded generators; nothing depends on a data set.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    budgets: Sequence[int], kinds: Sequence[str] = KINDS, per_cell: int = 1, seed: int = 0, max_doc: int | None = None
) -> list[tuple[str, list[int]]]:
    """`per_cell` micro-batches of every (kind, budget): a list of (kind, lengths)."""
    rng = np.random.default_rng(seed)
    return [(k, micro_batch(k, int(b), rng, max_doc)) for b in budgets for k in kinds for _ in range(per_cell)]


def _heavy_tail_docs(rng: np.random.Generator, budget: int) -> list[int]:
    """Pareto-tailed documents (32 tokens and up, tail index 1.2) filling `budget` tokens: another distribution than
    the grid's log-normal short documents with a few planted long ones."""
    out, left = [], budget
    while left > 0:
        d = int(min(32 * (1.0 + rng.pareto(1.2)), budget))
        out.append(min(d, left))
        left -= out[-1]
    return out


def fresh_budgets(budgets: Sequence[int]) -> list[int]:
    """Token budgets outside a grid: the geometric midpoint of each pair of neighbouring grid budgets and 1.5 times
    the largest (a single budget b: 0.7 b and 1.5 b), rounded to 16 tokens."""
    grid = sorted({int(b) for b in budgets})
    if len(grid) == 1:
        picks = [0.7 * grid[0], 1.5 * grid[0]]
    else:
        picks = [np.sqrt(a * b) for a, b in zip(grid, grid[1:])] + [1.5 * grid[-1]]
    out = sorted({max(16, int(round(p / 16)) * 16) for p in picks} - set(grid))
    return out


def fresh_micro_batches(budgets: Sequence[int], per_budget: int = 3, seed: int = 0) -> list[tuple[str, list[int]]]:
    """`per_budget` micro-batches of Pareto-tailed documents (kind "pareto") for every budget: micro-batches a
    calibration grid never holds, for checking a fitted model on data it was not fitted to."""
    rng = np.random.default_rng([seed, 0xF7E5])  # a stream the grid's generator never produces
    return [("pareto", _heavy_tail_docs(rng, int(b))) for b in budgets for _ in range(per_budget)]
