"""Held-out splits by micro-batch: a held-out micro-batch's documents are never timed in the fit.

A calibration times every micro-batch of the grid at several CP sizes and layouts. Holding out single timed samples
would leak: the same documents, timed at another CP size or layout, would sit in the fit. So the split is drawn over
micro-batch *compositions* (the multiset of document lengths; identical compositions always fall on the same side),
stratified by grid kind, and every sample of a held-out composition is held out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def composition(lengths: Sequence[int]) -> tuple[int, ...]:
    """The documents of a micro-batch as a sorted tuple: equal for micro-batches holding the same documents."""
    return tuple(sorted(int(d) for d in lengths))


def split_by_micro_batch(grid: Sequence[tuple[str, Sequence[int]]], held_out: float, seed: int) -> np.ndarray:
    """bool [len(grid)]: True for the grid micro-batches held out of the fit.

    Within every kind, `round(held_out * n)` of its n distinct compositions (at least one, at most n - 1 when n > 1)
    are drawn with `seed`; a composition that appears under several kinds is held out under all of them when any
    draw picks it."""
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be a fraction between 0 and 1, got {held_out}")
    rng = np.random.default_rng(seed)
    comps = [composition(lengths) for _, lengths in grid]
    picked: set[tuple[int, ...]] = set()
    for kind in sorted({k for k, _ in grid}):
        distinct = sorted({c for (k, _), c in zip(grid, comps) if k == kind})
        n = len(distinct)
        count = min(max(1, int(round(held_out * n))), n - 1) if n > 1 else 0
        for i in rng.permutation(n)[:count]:
            picked.add(distinct[int(i)])
    held = np.array([c in picked for c in comps], dtype=bool)
    if not held.any() and len(set(comps)) > 1:  # one composition per kind: hold out one of them
        chosen = comps[int(rng.integers(len(comps)))]
        held = np.array([c == chosen for c in comps], dtype=bool)
    return held


def leaked_compositions(samples: Sequence[dict]) -> set[tuple[int, ...]]:
    """Compositions present both among fitted samples and held-out ones (empty for a sound split)."""
    fitted = {composition(s["lengths"]) for s in samples if not s["held_out"] and not s.get("fresh")}
    held = {composition(s["lengths"]) for s in samples if s["held_out"]}
    return fitted & held
