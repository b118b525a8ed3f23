"""The group cuts of dynamic CP (step 2 of balancer.planning.dynamic.plan), for every micro-batch of an epoch at once.

A deal (documents to the parts of a cut, largest first) does not depend on the time budget; only whether the cut
is kept does. So the cuts every micro-batch could take are dealt first, level by level (one size per level) and
all micro-batches together (`_levels`); then the slots are decided in order, every replica of every step at once,
by comparing each candidate's slowest part with the slot's budget (`cut_epoch`). The result is the recursive rule
of the module docstring of balancer.planning.dynamic.plan: straight into the smallest size, else into the next smaller
one and each part again, a cut kept when every part is non-empty, within its token cap and within the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from balancer.planning.metrics import one_f_one_b
from balancer.planning.packing.rowops import argmin_last
from balancer.planning.speeds import block_speeds

EXACT = 32  # per part, this many of a micro-batch's largest documents are dealt one by one (the rest in runs)


@dataclass
class Cuts:
    """Per-entry cost and tokens, the cut sizes, the token cap, `group_times(entries, group, n_groups, size)`
    (the time of every group of entries on `size` ranks) and the pool ranks' speeds (None: even ranks; a group's
    time is divided by its slowest rank's speed)."""

    entry_cost: np.ndarray
    entry_tokens: np.ndarray
    smaller: dict[int, int]  # size -> the largest smaller size in cp_sizes dividing it
    max_tokens: int
    group_times: Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]
    speeds: np.ndarray | None = None

    def finest(self, size: int) -> int:
        while size in self.smaller:
            size = self.smaller[size]
        return size


@dataclass
class _Level:
    """Candidate groups of one size: micro-batch, first rank, entries (CSR, ascending) and time as a whole group;
    the deal into the finest size (`fin_*`) and into the next smaller one (`part_*`, children on the next level)."""

    size: int
    mb: np.ndarray
    start: np.ndarray
    ptr: np.ndarray
    entries: np.ndarray
    time: np.ndarray
    fin_size: int = 0
    fin_ok: np.ndarray | None = None
    fin_time: np.ndarray | None = None
    fin_times: np.ndarray | None = None
    fin_part: np.ndarray | None = None
    part_ok: np.ndarray | None = None
    part_time: np.ndarray | None = None
    child: np.ndarray | None = None  # index of a node's first child on the next level


def _positions(ptr: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Flat positions of the entries of `nodes` (in node order)."""
    lens = ptr[nodes + 1] - ptr[nodes]
    total = int(lens.sum())
    offsets = np.cumsum(lens) - lens
    return np.repeat(ptr[nodes] - offsets, lens) + np.arange(total, dtype=np.int64)


def deal(costs: np.ndarray, ptr: np.ndarray, parts: int, speeds: np.ndarray | None = None) -> np.ndarray:
    """Part of every item of every node (items `ptr[i]:ptr[i+1]` of node i) into `parts` parts of near-equal cost:
    each node's `EXACT * parts` largest by LPT (largest first, stable, each to the least-loaded part, ties to the
    lowest), the rest, in their order, cut into runs that fill each part's remaining room. All nodes at once.
    `speeds` [nodes, parts] (uneven ranks): parts of near-equal time instead, cost over speed (LPT to the part that
    finishes the item first; each part's room its speed's share of the node's cost)."""
    n_nodes = len(ptr) - 1
    counts = np.diff(ptr)
    node_of = np.repeat(np.arange(n_nodes), counts)
    order = np.lexsort((np.arange(len(costs)), -costs, node_of))
    part_of = np.zeros(len(costs), dtype=np.int64)
    dealt = np.minimum(counts, EXACT * parts)
    by_dealt = np.argsort(-dealt, kind="stable")
    first, dealt_sorted = ptr[by_dealt], dealt[by_dealt]
    loads = np.zeros((n_nodes, parts))
    active = np.searchsorted(-dealt_sorted, -np.arange(int(dealt.max(initial=0))), side="left")  # nodes with > r
    rows = np.arange(n_nodes)
    speed = None if speeds is None else speeds[by_dealt]
    for r, c in enumerate(active.tolist()):
        pos = order[first[:c] + r]
        p = argmin_last(loads[:c]) if speed is None else argmin_last((loads[:c] + costs[pos][:, None]) / speed[:c])
        part_of[pos] = p
        loads[rows[:c], p] += costs[pos]
    for i in np.flatnonzero(dealt_sorted < counts[by_dealt]).tolist():  # nodes with more items than dealt one by one
        node = by_dealt[i]
        rest = np.sort(order[ptr[node] + EXACT * parts : ptr[node + 1]])
        load = loads[i]
        share = 1 / parts if speed is None else speed[i] / speed[i].sum()
        room = np.maximum((load.sum() + costs[rest].sum()) * share - load, 0.0)
        before = np.cumsum(costs[rest]) - costs[rest] / 2  # an item goes where its midpoint falls
        part_of[rest] = np.minimum(np.searchsorted(np.cumsum(room), before, side="right"), parts - 1)
    return part_of


def _deal_level(cuts: Cuts, level: _Level, parts: int, part_size: int):
    """Deal every node of `level` into `parts` parts of `part_size` ranks: (ok [N], slowest part [N], part of each
    entry, every part's time [N * parts]); ok is False where a part is empty or over its token cap."""
    n = len(level.mb)
    speeds = None
    if cuts.speeds is not None:  # part p of node i runs on ranks [start_i + p * part_size, ...) at their slowest speed
        first = (level.start[:, None] + np.arange(parts)[None, :] * part_size).ravel()
        speeds = block_speeds(cuts.speeds, part_size)[first // part_size].reshape(n, parts)
    part_of = deal(cuts.entry_cost[level.entries], level.ptr, parts, speeds)
    gid = np.repeat(np.arange(n), np.diff(level.ptr)) * parts + part_of
    used = np.bincount(gid, minlength=n * parts).reshape(n, parts)
    tokens = np.bincount(gid, weights=cuts.entry_tokens[level.entries], minlength=n * parts).reshape(n, parts)
    ok = (used.min(axis=1) > 0) & (tokens.max(axis=1) <= part_size * cuts.max_tokens)
    times = np.full(n * parts, np.inf)
    good = np.repeat(ok, parts)
    if good.any():
        keep = good[gid]
        index = np.cumsum(good) - 1  # part ids renumbered over the ok nodes
        times[good] = cuts.group_times(level.entries[keep], index[gid[keep]], int(good.sum()), part_size)
    if speeds is not None:
        times = times / speeds.ravel()
    return ok, times.reshape(n, parts).max(axis=1), part_of, times


def _levels(cuts: Cuts, root: _Level, cap: np.ndarray) -> list[_Level]:
    """The candidate cuts of every micro-batch, level by level; `cap` [micro-batches] bounds every budget (a deal
    slower than it is never kept, and a smaller-size deal never taken when the finest one is as fast)."""
    levels, level = [], root
    while True:
        levels.append(level)
        part_size = cuts.smaller.get(level.size)
        if part_size is None or len(level.mb) == 0:
            return levels
        level.fin_size = cuts.finest(level.size)
        level.fin_ok, level.fin_time = np.zeros(len(level.mb), dtype=bool), np.full(len(level.mb), np.inf)
        if level.fin_size < part_size:
            ok, slowest, level.fin_part, level.fin_times = _deal_level(
                cuts, level, level.size // level.fin_size, level.fin_size
            )
            level.fin_ok, level.fin_time = ok & (slowest <= cap[level.mb]), slowest
        parts = level.size // part_size
        ok, slowest, part_of, times = _deal_level(cuts, level, parts, part_size)
        fin_first = level.fin_ok & (level.fin_time <= slowest)
        level.part_ok, level.part_time = ok & (slowest <= cap[level.mb]) & ~fin_first, slowest
        nodes = np.flatnonzero(level.part_ok)
        if len(nodes) == 0:
            return levels
        level.child = np.full(len(level.mb), -1, dtype=np.int64)
        level.child[nodes] = np.arange(len(nodes)) * parts
        level = _children(level, nodes, parts, part_size, part_of, times)


def _children(level: _Level, nodes: np.ndarray, parts: int, part_size: int, part_of, times) -> _Level:
    """The next level: the parts of `nodes`' deals, in node then part order, entries ascending."""
    pos = _positions(level.ptr, nodes)
    node_rank = np.repeat(np.arange(len(nodes)), level.ptr[nodes + 1] - level.ptr[nodes])
    child_of = node_rank * parts + part_of[pos]
    order = np.lexsort((pos, child_of))  # by child, entries keep their order
    child_ids = np.repeat(nodes, parts) * parts + np.tile(np.arange(parts), len(nodes))
    return _Level(
        size=part_size,
        mb=np.repeat(level.mb[nodes], parts),
        start=np.repeat(level.start[nodes], parts) + np.tile(np.arange(parts) * part_size, len(nodes)),
        ptr=np.concatenate([[0], np.cumsum(np.bincount(child_of, minlength=len(nodes) * parts))]),
        entries=level.entries[pos[order]],
        time=times[child_ids],
    )


def _resolve(levels: list[_Level], mbs: np.ndarray, budget: np.ndarray):
    """The cuts of micro-batches `mbs` under `budget` each: (taken [K]: the slowest final group, cut [K]: more than
    one group, picks: (task, level, node, finest?) arrays of the final groups)."""
    taken = np.zeros(len(mbs))
    picks = []
    task, nodes, b = np.arange(len(mbs)), mbs, budget
    for depth, level in enumerate(levels):
        if len(nodes) == 0:
            break
        fin = np.zeros(len(nodes), dtype=bool)
        if level.fin_ok is not None:
            assert level.fin_time is not None, "_levels sets fin_ok and fin_time together"
            fin = level.fin_ok[nodes] & (level.fin_time[nodes] <= b)
            np.maximum.at(taken, task[fin], level.fin_time[nodes[fin]])
        part = np.zeros(len(nodes), dtype=bool)
        if level.part_ok is not None:
            assert level.part_time is not None, "_levels sets part_ok and part_time together"
            part = ~fin & level.part_ok[nodes] & (level.part_time[nodes] <= b)
        whole = ~fin & ~part
        np.maximum.at(taken, task[whole], level.time[nodes[whole]])
        done = fin | whole
        picks.append((task[done], np.full(int(done.sum()), depth), nodes[done], fin[done]))
        if not part.any():
            break
        parts = level.size // levels[depth + 1].size
        assert level.child is not None, "a level with parts taken has children"
        task = np.repeat(task[part], parts)
        b = np.repeat(b[part], parts)
        nodes = (level.child[nodes[part]][:, None] + np.arange(parts)).ravel()
    return taken, _not_root(picks, len(mbs)), picks


def _not_root(picks, k: int) -> np.ndarray:
    """Tasks whose final groups are anything but their whole root micro-batch."""
    root_whole = np.zeros(k, dtype=bool)
    t, depth, _, fin = picks[0]
    root_whole[t[(depth == 0) & ~fin]] = True
    return ~root_whole


def cut_epoch(
    cuts: Cuts,
    mb_ptr: np.ndarray,
    slot_time: np.ndarray,
    limit: np.ndarray,
    large: int,
    shape: tuple[int, int, int],
    pp: int,
) -> tuple:
    """Cut every micro-batch (`mb_ptr`, time `slot_time` on its `large` group; `shape` = (steps, replicas, M)) such
    that each large group's ranks finish within its step's `limit` (1F1B over `pp` stages: see
    dynamic.split_groups). Returns the entry order, each group's first rank, size and entry count, the slot pointer
    and each group's time."""
    steps, replicas, m = shape
    mb = np.arange(len(mb_ptr) - 1)
    root = _Level(large, mb, ((mb // m) % replicas) * large, mb_ptr, np.arange(mb_ptr[-1]), slot_time)
    levels = _levels(cuts, root, np.repeat(limit, replicas * m))
    times = slot_time.reshape(shape)
    slowest, total = times.max(axis=2).ravel(), times.sum(axis=2).ravel()
    lim = np.repeat(limit, replicas)
    picks = []
    for slot in range(m):
        mbs = np.arange(steps * replicas) * m + slot
        rest = total - slot_time[mbs]
        budget = lim - (pp - 1) * slowest - rest  # the largest x with (P-1) * max(slowest, x) + rest + x <= limit
        budget = np.where(budget > slowest, (lim - rest) / pp, budget)
        taken, cut, chosen = _resolve(levels, mbs, np.maximum(budget, slot_time[mbs]))
        revert = cut & (one_f_one_b(np.maximum(slowest, taken), rest + taken, pp) > lim)  # rounding: keep it whole
        taken = np.where(revert, slot_time[mbs], taken)
        total, slowest = rest + taken, np.maximum(slowest, taken)
        for task, depth, nodes, fin in chosen:
            keep = ~revert[task]
            picks.append((depth[keep], nodes[keep], fin[keep]))
        back = mbs[revert]
        picks.append((np.zeros(len(back), dtype=np.int64), back, np.zeros(len(back), dtype=bool)))
    return _assemble(levels, picks, replicas * large, m, replicas)


def _assemble(levels: list[_Level], picks: list, pool: int, m: int, replicas: int):
    """The chosen groups as plan arrays, slot by slot, each slot's groups by first rank, entries ascending."""
    depth = np.concatenate([p[0] for p in picks])
    nodes = np.concatenate([p[1] for p in picks])
    fin = np.concatenate([p[2] for p in picks])
    parts = []
    for d, level in enumerate(levels):
        for finest in (False, True):
            sel = nodes[(depth == d) & (fin == finest)]
            if len(sel) == 0:
                continue
            pos = _positions(level.ptr, sel)
            node = np.repeat(sel, level.ptr[sel + 1] - level.ptr[sel])
            start, size, time = level.start[node], np.full(len(pos), level.size), level.time[node]
            if finest:
                assert level.fin_part is not None and level.fin_times is not None, "finest picks come from a deal"
                part = level.fin_part[pos]
                start = start + part * level.fin_size
                size[:] = level.fin_size
                time = level.fin_times[node * (level.size // level.fin_size) + part]
            mb = level.mb[node]
            slot = (mb // (replicas * m)) * m + mb % m
            parts.append((level.entries[pos], slot * pool + start, size, time))
    entries, key, size, time = (np.concatenate([p[i] for p in parts]) for i in range(4))
    order = np.lexsort((entries, key))
    entries, key, size, time = entries[order], key[order], size[order], time[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    counts = np.diff(np.r_[first, len(key)])
    slot_ptr = np.searchsorted(key[first] // pool, np.arange(len(levels[0].mb) // replicas + 1))
    return entries, key[first] % pool, size[first], counts, slot_ptr, time[first]
