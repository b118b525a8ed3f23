"""The planner: cost-aware assignment of documents to steps, DP replicas and micro-batches.

An epoch is planned in three moves, all vectorised except for loops over steps and over the few heavy documents:

1. *Shuffle and cut into steps.* Documents are shuffled by `seed`. Documents heavier than a fraction of a
   micro-batch's fair share ("heavy") are spread over the steps in shuffled order so that every step gets an equal
   share of heavy cost; the light documents then fill each step, in shuffled order, up to the step's token target.
   Only heavy documents move by more than a few positions (`mean_delay_steps` reports it); nothing is sorted by
   length.
2. *Pack each step* (`pack_step`): heavy documents go one by one, largest first, to the micro-batch that least
   raises its replica's 1F1B time `(P-1) * max_m t_m + sum_m t_m`; a water-filling solve then gives every
   micro-batch a target so that all replicas finish together; the light documents, largest first, are dealt in
   rounds to the micro-batches still below target (batched LPT), never above `max_tokens * cp` tokens.
3. *Repair.* Empty micro-batches take a small document from the fullest one; documents that fit nowhere (or would
   only slow the step) move to the next step; a too-small last step borrows small documents from earlier ones.

Inside each micro-batch, documents keep their shuffled order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from balancer.planning.binpack import pack_step, step_time
from balancer.planning.cost import CostModel
from balancer.planning.dynamic import plan_dynamic
from balancer.planning.fastpack import LazySteps, pack_light_steps, steps_to_repack
from balancer.planning.metrics import natural_steps, step_times
from balancer.planning.plans import Plan
from balancer.planning.steps import (
    STEP_BAND,
    assign_steps,
    borrow_for_small_steps,
    effective_step_tokens,
    equal_row_steps,
    pack_equal_rows,
    step_token_targets,
)
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES, planning_units, validate_lengths

ATTN_SHARE = 1 / 3  # a unit is attention-heavy when attention is at least this share of its cost
PROGRESS_AFTER = 2.0  # seconds before a progress bar (progress=True) appears
SLOW_PLAN = 10.0  # seconds: a plan that takes longer is logged (once per process)

log = logging.getLogger(__name__)
_slow_logged = False  # the slow-planning line is logged once per process

__all__ = ["plan", "pack_step", "step_token_targets", "validate_lengths", "OVERFLOW_POLICIES"]


def plan(
    lengths: Sequence[int] | np.ndarray,
    topology: Topology,
    cost: CostModel,
    seed: int = 0,
    overflow: str = "error",
    progress: bool = False,
) -> Plan:
    """Plan a whole epoch: every document exactly once, `micro_batches` non-empty micro-batches per replica per step
    (with `topology.cp_sizes`: per slot, a partition of the pool into CP groups, each with a non-empty micro-batch;
    see balancer.planning.dynamic).

    `overflow` decides what happens to a document longer than `max_tokens * cp`: "error" (default) raises,
    "split" cuts it into consecutive windows (recorded as spans), "truncate" keeps its first `max_tokens * cp`
    tokens (the rest is counted in `dropped_tokens`).
    """
    started = time.perf_counter()
    lengths = validate_lengths(lengths)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a balancer.Topology, got {type(topology).__name__}")
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a balancer.CostModel, got {type(cost).__name__}")
    if topology.dynamic:
        return plan_dynamic(lengths, topology, cost, seed, overflow, progress, static_plan=plan)
    nb = topology.bins_per_step
    u_doc, u_start, u_end = planning_units(lengths, topology.micro_batch_tokens, overflow, topology)
    if len(u_doc) < nb:
        raise ValueError(
            f"{len(u_doc)} documents cannot fill dp*micro_batches = {topology.dp}*"
            f"{topology.micro_batches} = {nb} non-empty micro-batches; lower dp or micro_batches"
        )
    doc_order, shuffled = _shuffle(len(lengths), u_doc, seed)
    u_tok = (u_end - u_start)[shuffled]
    u_cost = cost.cost(u_tok)
    # only documents whose attention is a large part of their cost need spreading or grouping over the steps;
    # the rest fill the steps by tokens in shuffled order
    attn_heavy = (u_cost - cost.linear_coef * u_tok) >= ATTN_SHARE * u_cost
    if u_tok.min() == u_tok.max():  # fixed-length rows: whole rows per step, dealt evenly
        rows = equal_row_steps(len(u_tok), int(u_tok[0]), topology)
        targets = rows * float(u_tok[0])
        packed = pack_equal_rows(rows, topology)
    else:
        step_tokens = _choose_step_tokens(u_cost, u_tok, attn_heavy, topology, seed)
        # a step must hold at least one document per micro-batch: with tokens_per_step below that (tiny budgets
        # or huge documents) +-10% cannot hold, so steps grow to fit a few documents per micro-batch
        floor = int(1.25 * nb * u_tok.mean())
        targets = step_token_targets(int(u_tok.sum()), step_tokens, topology.capacity, topology.tokens_per_step, floor)
        rng = np.random.default_rng([seed, 1])
        packed = _pack_epoch(u_cost, u_tok, attn_heavy, targets, topology, rng, progress)

    sizes = np.concatenate([mb_sizes for _, mb_sizes in packed]).ravel()
    unit = shuffled[np.concatenate([units for units, _ in packed])]
    one_each = len(u_doc) == len(lengths) and np.array_equal(u_end, lengths)  # no document cut or truncated
    whole = one_each or (u_start[unit] == 0) & (u_end[unit] == lengths[u_doc[unit]])
    if not np.all(whole):  # inside a micro-batch: whole documents first, then spans (the Plan layout)
        mb_id = np.repeat(np.arange(len(sizes)), sizes)
        unit = unit[np.argsort(mb_id * 2 + ~whole, kind="stable")]
    placed_tokens = lengths if one_each else np.bincount(u_doc, weights=u_end - u_start, minlength=len(lengths))
    placed_tokens = placed_tokens.astype(np.int64, copy=False)
    _log_if_slow(time.perf_counter() - started, len(lengths), len(sizes) // nb, topology)
    if one_each:  # units are the documents: ids are positions, every span starts at 0
        doc, start, end = unit, np.zeros(len(unit), dtype=u_start.dtype), lengths[unit]
    else:
        doc, start, end = u_doc[unit], u_start[unit], u_end[unit]
    return Plan(
        lengths,
        topology,
        cost,
        doc,
        start,
        end,
        np.concatenate([[0], np.cumsum(sizes)]),
        seed=seed,
        natural_step=natural_steps(doc_order, placed_tokens, int(round(float(np.mean(targets))))),
        plan_seconds=time.perf_counter() - started,
    )


def _shuffle(num_docs: int, u_doc: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The shuffled document order for `seed`, and the units (of documents `u_doc`) in that order."""
    doc_order = np.random.default_rng(seed).permutation(num_docs)
    if len(u_doc) == num_docs:  # one unit per document
        return doc_order, doc_order
    position = np.empty_like(doc_order)
    position[doc_order] = np.arange(num_docs)
    return doc_order, np.argsort(position[u_doc], kind="stable")


def _pack_epoch(
    u_cost: np.ndarray,
    u_tok: np.ndarray,
    attn_heavy: np.ndarray,
    targets: np.ndarray,
    topology: Topology,
    rng: np.random.Generator,
    progress: bool = False,
) -> list:
    """Cut the shuffled units into steps and pack each; returns the packed epoch as pieces of consecutive steps
    (units sorted by step and micro-batch, [steps, micro-batches] sizes).

    Every step without attention-heavy units is first packed by the batched LPT of balancer.planning.fastpack (all
    such steps at once) and polished by the batched local search; a step keeps that packing unless
    `fastpack.steps_to_repack` sends it to `pack_step`, or units moved into it from the step before."""
    nb = topology.bins_per_step
    groups = _cut_steps(u_cost, u_tok, attn_heavy, targets, nb, rng, grouped=topology.pp > 1)
    flat = np.concatenate(groups)
    ptr = np.concatenate([[0], np.cumsum([len(g) for g in groups])])
    fast_bin = pack_light_steps(flat, ptr, u_cost, u_tok, attn_heavy, topology)
    repack, complete = steps_to_repack(fast_bin, u_cost[flat], u_tok[flat], ptr, topology)
    fast = LazySteps(fast_bin, ptr, complete)
    # the good steps' result, sorted by micro-batch in one go (the -1 of incomplete steps sorts first, unused)
    step = np.repeat(np.arange(len(groups)), np.diff(ptr))
    slot = step * (nb + 1) + fast_bin + 1
    if len(groups) * (nb + 1) < 2**62 // max(len(u_cost), 1):  # by micro-batch, shuffled order inside (unique keys)
        by_bin = flat[np.argsort(slot * len(u_cost) + flat)]
    else:
        by_bin = flat[np.lexsort((flat, slot))]
    sizes = np.bincount(slot, minlength=len(groups) * (nb + 1)).reshape(len(groups), nb + 1)[:, 1:]
    batched = _Batched(by_bin, ptr, sizes, ready=~repack, fast=fast)
    return _settle(groups, batched, u_cost, u_tok, attn_heavy, targets, topology, progress)


def _cut_steps(
    u_cost: np.ndarray,
    u_tok: np.ndarray,
    attn_heavy: np.ndarray,
    targets: np.ndarray,
    nb: int,
    rng: np.random.Generator,
    grouped: bool,
) -> list[np.ndarray]:
    """The units of every step (`assign_steps`), each step with at least `nb` units, then light units traded
    between neighbours so that steps hold their token targets (`_hold_step_tokens`, only where a step is off)."""
    step_of = assign_steps(u_cost, u_tok, targets, nb, rng, grouped=grouped, attn_heavy=attn_heavy)
    key = step_of.astype(np.int16) if len(targets) < 2**15 else step_of  # 16-bit keys sort by radix
    by_step = np.argsort(key, kind="stable")  # shuffled order kept inside a step
    bounds = np.searchsorted(step_of[by_step], np.arange(len(targets) + 1))
    groups = [by_step[bounds[s] : bounds[s + 1]] for s in range(len(targets))]
    borrow_for_small_steps(groups, u_cost, nb)
    sizes = np.array([len(g) for g in groups])
    totals = np.zeros(len(groups))
    totals[sizes > 0] = np.add.reduceat(u_tok[np.concatenate(groups)], (np.cumsum(sizes) - sizes)[sizes > 0])
    step_target = targets[np.minimum(np.arange(len(groups)), len(targets) - 1)]
    off = np.flatnonzero(np.abs(totals - step_target) > 0.02 * step_target)
    s = int(off[0]) if len(off) else len(groups)
    while s < len(groups) - 1:  # the steps off their target, and each step the one before traded units with
        before = groups[s + 1]
        groups[s] = _hold_step_tokens(groups[s], groups, s, float(step_target[s]), u_tok, attn_heavy, nb)
        if groups[s + 1] is not before:
            s += 1
        else:
            k = int(np.searchsorted(off, s + 1))
            s = int(off[k]) if k < len(off) else len(groups)
    return groups


@dataclass
class _Batched:
    """The batched packing of an epoch's steps: units sorted by step and micro-batch (`by_bin[ptr[s]:ptr[s + 1]]`),
    [steps, micro-batches] sizes, which steps can be taken as they are (`ready`), and each complete step's
    micro-batches (`fast`, for comparing with `pack_step`). A step whose units change is forgotten in both."""

    by_bin: np.ndarray
    ptr: np.ndarray
    sizes: np.ndarray
    ready: np.ndarray
    fast: LazySteps

    def __post_init__(self) -> None:
        not_ready = np.append(np.flatnonzero(~self.ready), len(self.ready))
        self.next_unready = not_ready[np.searchsorted(not_ready, np.arange(len(self.ready)))]

    def take(self, s: int) -> bool:
        return s < len(self.ready) and bool(self.ready[s])

    def forget(self, s: int) -> None:
        if s < len(self.ready):
            self.ready[s] = False
            self.fast[s] = None


def _settle(
    groups: list,
    batched: _Batched,
    u_cost: np.ndarray,
    u_tok: np.ndarray,
    attn_heavy: np.ndarray,
    targets: np.ndarray,
    topology: Topology,
    progress: bool,
) -> list:
    """Step by step: take the batched packing (good enough, sorted by micro-batch) where the step is ready and its
    units did not change, a run of ready steps at once; else pack with `pack_step` (keeping the batched packing
    when that is faster), move what fits nowhere on to the next step (which then is re-packed too) and backfill;
    a too-small overflow step borrows from earlier ones. Returns pieces (units by step and micro-batch,
    [steps, micro-batches] sizes) of consecutive steps."""
    packed: list[tuple[np.ndarray, np.ndarray]] = []
    carry = np.zeros(0, dtype=np.int64)
    s = 0
    bar = _progress(len(groups), progress)
    while s < len(groups) or len(carry):
        if not len(carry) and s + 1 < len(groups) and batched.take(s):
            # the common case: nothing moved in, the batched packing is good (forgetting only ever reaches the
            # step after the one being settled, so the run ends where the first unready step was at the start)
            end = min(int(batched.next_unready[s]), len(groups) - 1)  # the last step may overflow: settled
            packed.append((batched.by_bin[batched.ptr[s] : batched.ptr[end]], batched.sizes[s:end]))
            done = end - s
        else:
            carry = _settle_step(s, carry, groups, batched, packed, u_cost, u_tok, attn_heavy, targets, topology)
            done = 1
        s += done
        if bar:
            bar.update(done)
        if s > 4 * len(groups) + 10:
            raise RuntimeError("planner failed to place all documents (units fit no micro-batch)")
    if bar:
        bar.close()
    return packed


def _settle_step(s, carry, groups, batched, packed, u_cost, u_tok, attn_heavy, targets, topology) -> np.ndarray:
    """Pack step `s` (with the units `carry` moved in from the step before) onto `packed`; returns the units that
    move on to the next step."""
    nb = topology.bins_per_step
    units = groups[s] if s < len(groups) else np.zeros(0, dtype=np.int64)
    unit_bin = batched.fast[s] if s < len(batched.fast) and not len(carry) else None
    units = np.concatenate([carry, units])
    if s == len(groups) - 1 and u_tok[units].sum() > 1.1 * targets.max() and len(units) > 2 * nb:
        groups.append(np.zeros(0, dtype=np.int64))  # the last step overflows: open one more
    if unit_bin is None and s + 1 < len(groups):
        target = float(targets[s]) if s < len(targets) else float(targets.max())
        before = groups[s + 1]
        units = _hold_step_tokens(units, groups, s, target, u_tok, attn_heavy, nb)
        if groups[s + 1] is not before:  # units moved to or from the next step: its batched packing is stale
            batched.forget(s + 1)
    if len(units) < nb and packed:
        units, unit_bin = _reopen_last_step(packed, units, u_cost, nb), None
    if unit_bin is None or not batched.take(s):
        unit_bin = _faster(unit_bin, pack_step(u_cost[units], u_tok[units], topology), u_cost[units], topology)
    carry = units[unit_bin < 0]
    placed = units[unit_bin >= 0]
    bins = unit_bin[unit_bin >= 0]
    if len(carry) and s + 1 < len(groups):
        placed, bins = _backfill(
            placed, bins, float(u_tok[carry].sum()), groups, s, u_tok, u_cost, attn_heavy, topology
        )
        batched.forget(s + 1)
    by_bin = np.argsort(bins * len(u_cost) + placed)  # by micro-batch, shuffled order inside (unique keys)
    packed.append((placed[by_bin], np.bincount(bins, minlength=nb)[None, :]))
    return carry


def _faster(fast: np.ndarray | None, packed: np.ndarray, cost: np.ndarray, topology: Topology) -> np.ndarray:
    """The faster of a step's batched packing (None: none) and `pack_step`'s (which may leave units unplaced)."""
    if fast is None or step_time(packed, cost, topology) < step_time(fast, cost, topology):
        return packed
    return fast


def _hold_step_tokens(
    units: np.ndarray, groups: list, s: int, target: float, u_tok: np.ndarray, attn_heavy: np.ndarray, nb: int
) -> np.ndarray:
    """Keep step `s` within 2% of its token target by trading light units with the next step (in place on
    `groups[s + 1]`): trailing light units move on when the step is too big, leading light units of the next step
    come forward when it is too small. Units larger than what is left to trade are skipped; when
    the step is still off then, one unit that overshoots the target but lands closer to it is traded."""
    total = float(u_tok[units].sum())
    tol = 0.01 * target
    if abs(total - target) <= 2 * tol:
        return units
    nxt = groups[s + 1]
    if total > target:
        pool, budget, room = np.flatnonzero(~attn_heavy[units])[::-1], total - target, len(units) - nb
    else:
        pool, budget, room = np.flatnonzero(~attn_heavy[nxt]), target - total, len(nxt) - nb
    src = units if total > target else nxt
    chosen = []
    for k, t in zip(pool.tolist(), u_tok[src[pool]].tolist()):
        if budget <= tol or len(chosen) >= room:
            break
        if t <= budget + tol:
            chosen.append(k)
            budget -= t
    if budget > 2 * tol and len(chosen) < room:
        # every unit left is larger than the gap (e.g. a step of heavy documents and a few large light ones): trade
        # the one that brings the step closest to its target, overshooting it, when that is closer than now
        rest = np.setdiff1d(pool, chosen, assume_unique=True)
        if len(rest):
            miss = np.abs(u_tok[src[rest]] - budget)
            best = int(np.argmin(miss))
            if miss[best] < budget:
                chosen.append(int(rest[best]))
    if not chosen:
        return units
    mask = np.zeros(len(src), dtype=bool)
    mask[chosen] = True
    if total > target:
        groups[s + 1] = np.concatenate([units[mask], nxt])
        return units[~mask]
    groups[s + 1] = nxt[~mask]
    return np.concatenate([units, nxt[mask]])


def _backfill(
    placed: np.ndarray,
    bins: np.ndarray,
    gap: float,
    groups: list,
    s: int,
    u_tok: np.ndarray,
    u_cost: np.ndarray,
    attn_heavy: np.ndarray,
    topology: Topology,
):
    """Units that fit nowhere move to the next step; pull up to as many tokens of small light units of the next
    step into the leftover room (neediest micro-batch first), so the step keeps its size (in place on groups)."""
    nb, cap = topology.bins_per_step, topology.micro_batch_tokens
    tok = np.bincount(bins, weights=u_tok[placed], minlength=nb)
    load = np.bincount(bins, weights=u_cost[placed], minlength=nb)
    nxt = groups[s + 1]
    cand = np.flatnonzero(~attn_heavy[nxt])
    cand = cand[np.argsort(u_tok[nxt[cand]], kind="stable")]
    taken, new_bins, moved = [], [], 0.0
    for k in cand:
        if moved >= gap or len(nxt) - len(taken) <= nb:
            break
        u = nxt[k]
        room = np.where(tok + u_tok[u] <= cap, -load, -np.inf)
        j = int(np.argmax(room))
        if not np.isfinite(room[j]):
            break  # smallest remaining unit fits nowhere
        taken.append(k)
        new_bins.append(j)
        tok[j] += u_tok[u]
        load[j] += u_cost[u]
        moved += u_tok[u]
    if not taken:
        return placed, bins
    keep = np.ones(len(nxt), dtype=bool)
    keep[taken] = False
    groups[s + 1] = nxt[keep]
    return np.concatenate([placed, nxt[taken]]), np.concatenate([bins, np.array(new_bins, dtype=np.int64)])


def _epoch_time(packed: list, u_cost: np.ndarray, topology: Topology) -> float:
    """Sum of step times of a packed epoch (per-CP-rank cost units)."""
    units = np.concatenate([units for units, _ in packed])
    sizes = np.concatenate([sizes for _, sizes in packed]).ravel()
    per_mb = np.bincount(np.repeat(np.arange(len(sizes)), sizes), weights=u_cost[units], minlength=len(sizes))
    return float(step_times(per_mb.reshape(-1, topology.dp, topology.micro_batches), topology).sum())


def _choose_step_tokens(
    u_cost: np.ndarray, u_tok: np.ndarray, attn_heavy: np.ndarray, topology: Topology, seed: int
) -> int:
    """Step size in tokens, inside STEP_BAND around `tokens_per_step`.

    Two forces pull on it: heavy documents need token room beyond their tokens (smaller steps, see
    `effective_step_tokens`), and a document whose cost exceeds a replica's share of its step stalls that step
    (bigger steps). When they disagree, both sizes are tried on a sample of the epoch (the first ~12 steps of the
    shuffled order) and the faster one is kept.
    """
    tps = topology.tokens_per_step
    shrunk = effective_step_tokens(u_cost, u_tok, topology)
    steps = max(1.0, float(u_tok.sum()) / tps)
    t = topology
    share = u_cost.sum() / steps / (t.dp * t.cp) * (1 + (t.pp - 1) / t.micro_batches)
    stalls = t.pp * u_cost.max() / t.cp > 0.8 * share
    if shrunk >= tps or not stalls or steps < 2:
        return shrunk
    candidates = sorted({shrunk, tps, min(int(STEP_BAND[1] * tps), int(0.97 * t.capacity))})
    k = int(np.searchsorted(np.cumsum(u_tok), 12 * tps)) + 1
    c, tok, heavy = u_cost[:k], u_tok[:k], attn_heavy[:k]
    best, best_time = shrunk, np.inf
    for x in candidates:
        targets = step_token_targets(int(tok.sum()), x, t.capacity, tps)
        try:
            packed = _pack_epoch(c, tok, heavy, targets, t, np.random.default_rng([seed, 2]))
        except (ValueError, RuntimeError):
            continue
        et = _epoch_time(packed, c, t)
        if et < best_time * (1 - 1e-3):
            best, best_time = x, et
    return best


def _reopen_last_step(packed: list, units: np.ndarray, u_cost: np.ndarray, nb: int) -> np.ndarray:
    """An overflow step too small to fill every micro-batch borrows the cheapest units of earlier steps (latest
    first), never emptying one of their micro-batches (in place on `packed`)."""
    borrowed = [units]
    need = nb - len(units)
    back = len(packed) - 1
    while need > 0 and back >= 0:
        back = _last_step_alone(packed, back)
        flat, sizes = packed[back]
        mb_of = np.repeat(np.arange(nb), sizes[0])
        left = sizes[0].copy()
        take = []
        for k in np.argsort(u_cost[flat], kind="stable"):
            if len(take) == need:
                break
            if left[mb_of[k]] > 1:
                left[mb_of[k]] -= 1
                take.append(k)
        keep = np.ones(len(flat), dtype=bool)
        keep[take] = False
        packed[back] = (flat[keep], left[None, :])
        borrowed.append(np.sort(flat[take]))
        need -= len(take)
        back -= 1
    if need > 0:
        raise ValueError(
            f"cannot give every one of the {nb} micro-batches of the last step a document: the documents are too "
            f"large for the step size ({len(units)} left for the last step, and every micro-batch of the steps before "
            "holds one); raise Topology.max_tokens so that a micro-batch holds two documents, or lower Topology.dp "
            "or Topology.micro_batches"
        )
    return np.concatenate(borrowed)


def _last_step_alone(packed: list, index: int) -> int:
    """Split piece `index` of `packed` so that its last step is a piece of its own; returns that piece's index."""
    units, sizes = packed[index]
    if len(sizes) == 1:
        return index
    cut = len(units) - int(sizes[-1].sum())
    packed[index : index + 1] = [(units[:cut], sizes[:-1]), (units[cut:], sizes[-1:])]
    return index + 1


def _log_if_slow(seconds: float, documents: int, steps: int, topology: Topology) -> None:
    """One log line (INFO, once per process) when planning took long: every rank pays it at every epoch start."""
    global _slow_logged
    if seconds > SLOW_PLAN and not _slow_logged:
        _slow_logged = True
        log.info(
            "planning %d documents into %d steps on %s took %.1f s (every rank plans at every epoch start)",
            documents,
            steps,
            topology,
            seconds,
        )


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="planning steps", unit="step", delay=PROGRESS_AFTER)
