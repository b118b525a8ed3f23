"""Best-fit-decreasing packing of planning units into micro-batches of `cap` tokens: the packing a fixed step count
is proven against, and the packing settling falls back on when its own cannot place every unit in that count.

Units are taken largest first (ties by index) and each goes to the micro-batch with the least room that still holds
it, or opens a new one. A unit opens a new micro-batch only when every open one has less room than it, and at that
point every open micro-batch holds units at least as large as it (largest first): so when a unit of `s` tokens opens
the last one, the `B - 1` before hold more than `cap - s` tokens each, all from units of at least `s` tokens. That
gives a bound on `B` from a few token sums alone (`class_sums`, `fit_bound`), which a window's step count reads
without packing; where that bound is above the count, the count packs (`best_fit_count`).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from balancer.planning.metrics import one_f_one_b
from balancer.planning.topology import Topology

__all__ = ["SMALL_CLASSES", "best_fit", "best_fit_count", "best_fit_steps", "class_of", "class_sums", "fit_bound"]

SMALL_CLASSES = 8  # units of at most cap/2 tokens in classes (e_{j-1}, e_j], e_j = j * cap / (2 * SMALL_CLASSES)


def class_of(tokens: np.ndarray, cap: int) -> np.ndarray:
    """The class (0 .. SMALL_CLASSES - 1) of units of at most cap/2 `tokens` (`fit_bound`'s)."""
    j = -(-np.asarray(tokens, dtype=np.int64) * (2 * SMALL_CLASSES) // cap) - 1
    return np.clip(j, 0, SMALL_CLASSES - 1)


def class_sums(tokens: np.ndarray, cap: int) -> np.ndarray:
    """Tokens per class of the units of at most cap/2 `tokens` (units over cap/2 are left out)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    small = tokens[2 * tokens <= cap]
    return np.bincount(class_of(small, cap), weights=small, minlength=SMALL_CLASSES).round().astype(np.int64)


def fit_bound(total: int, units: int, big: int, small: np.ndarray, cap: int) -> int:
    """An upper bound on the micro-batches `best_fit` opens for `units` units of `total` tokens, `big` of them over
    cap/2, with `small` their class sums (`class_sums`): the last micro-batch is opened by a unit over cap/2 (then
    `big` in all) or by one of class j, when the ones before hold more than `cap - e_j` each from units of more than
    `e_{j-1}` tokens (module docstring); never more than `units`."""
    bound = int(big)
    small = np.asarray(small, dtype=np.int64)
    above = int(total) - int(small.sum())  # tokens of the units over cap/2
    for j in range(SMALL_CLASSES - 1, -1, -1):
        above += int(small[j])
        if small[j]:
            room = cap - (j + 1) * cap // (2 * SMALL_CLASSES)  # cap less the largest unit class j holds
            bound = max(bound, -(-above // room))
    return min(bound, int(units))


def best_fit(tokens: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """(micro-batch of every unit, micro-batches opened) of best-fit-decreasing packing (module docstring); units
    over `cap` are refused."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) and int(tokens.max()) > cap:
        raise ValueError(f"best_fit: a unit of {int(tokens.max())} tokens is over the micro-batch's {cap}")
    order = np.lexsort((np.arange(len(tokens)), -tokens))
    bin_of = np.empty(len(tokens), dtype=np.int64)
    big = int(np.count_nonzero(2 * tokens > cap))  # each alone: no two share a micro-batch
    bin_of[order[:big]] = np.arange(big)
    scale = len(tokens) + 1  # a micro-batch as one key: room * scale + its index (least room, then index, first)
    free = _Keys(sorted(((cap - tokens[order[:big]]) * scale + np.arange(big)).tolist()))
    opened = big
    for u, t in zip(order[big:].tolist(), tokens[order[big:]].tolist()):
        key = free.pop_from(t * scale)
        if key is None:
            b, room = opened, cap
            opened += 1
        else:
            room, b = divmod(key, scale)
        bin_of[u] = b
        free.add((room - t) * scale + b)
    return bin_of, opened


class _Keys:
    """A sorted multiset of ints in chunks of at most 2 * CHUNK (O(log n + CHUNK) a call, where one sorted list
    costs O(n) an insertion: best-fit of a million units near half the micro-batch took minutes)."""

    CHUNK = 256

    def __init__(self, keys: list) -> None:
        self.chunks = [keys[i : i + self.CHUNK] for i in range(0, len(keys), self.CHUNK)]
        self.tops = [c[-1] for c in self.chunks]

    def pop_from(self, low: int):
        """Remove and return the least key >= `low` (None when there is none)."""
        i = bisect_left(self.tops, low)
        if i == len(self.tops):
            return None
        chunk = self.chunks[i]
        key = chunk.pop(bisect_left(chunk, low))
        if chunk:
            self.tops[i] = chunk[-1]
        else:
            del self.chunks[i], self.tops[i]
        return key

    def add(self, key: int) -> None:
        if not self.chunks:
            self.chunks, self.tops = [[key]], [key]
            return
        i = min(bisect_left(self.tops, key), len(self.tops) - 1)
        chunk = self.chunks[i]
        insort(chunk, key)
        self.tops[i] = chunk[-1]
        if len(chunk) > 2 * self.CHUNK:
            self.chunks[i : i + 1] = [chunk[: self.CHUNK], chunk[self.CHUNK :]]
            self.tops[i : i + 1] = [chunk[self.CHUNK - 1], chunk[-1]]


def best_fit_count(tokens: np.ndarray, cap: int) -> int:
    """The micro-batches `best_fit` opens."""
    return best_fit(tokens, cap)[1]


def best_fit_steps(
    units: np.ndarray, u_tok: np.ndarray, u_cost: np.ndarray, topology: Topology, steps: int
) -> list | None:
    """`units` in exactly `steps` steps by `best_fit` (None when it needs more micro-batches than they have): every
    micro-batch non-empty (a unit moved from the fullest-counted micro-batch into each empty one), the micro-batches
    dealt to the replicas of the steps largest cost first, each to the replica with the least 1F1B time that has a
    free slot. Returns the epoch as one piece (units by step and micro-batch, [steps, micro-batches] sizes)."""
    nb, m, dp = topology.bins_per_step, topology.micro_batches, topology.dp
    slots = steps * nb
    bin_of, opened = best_fit(u_tok[units], topology.micro_batch_tokens)
    if opened > slots or len(units) < slots:
        return None
    counts = np.bincount(bin_of, minlength=slots)
    for empty in range(opened, slots):  # any unit fits an empty micro-batch alone
        donor = int(np.argmax(counts))
        k = int(np.flatnonzero(bin_of == donor)[0])
        bin_of[k], counts[donor], counts[empty] = empty, counts[donor] - 1, 1
    cost = np.bincount(bin_of, weights=u_cost[units], minlength=slots)
    replicas = steps * dp
    load, peak, free = np.zeros(replicas), np.zeros(replicas), np.full(replicas, m)
    slot_of = np.empty(slots, dtype=np.int64)
    for b in np.argsort(-cost, kind="stable").tolist():
        time = np.where(free > 0, one_f_one_b(np.maximum(peak, cost[b]), load + cost[b], topology.pp), np.inf)
        r = int(np.argmin(time))
        slot_of[b] = r * m + (m - free[r])
        free[r] -= 1
        load[r] += cost[b]
        peak[r] = max(peak[r], cost[b])
    mb = slot_of[bin_of]
    order = np.lexsort((units, mb))
    return [(units[order], np.bincount(mb, minlength=slots).reshape(steps, nb))]
