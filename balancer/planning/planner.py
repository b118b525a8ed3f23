"""The planner: cost-aware assignment of documents to steps, DP replicas and micro-batches (`plan`).

An epoch is planned in five moves (docs/planner.md has each in full), all vectorised except for loops over steps and
over the few heavy documents:

1. *Shuffle* (shuffle.py): documents are shuffled by `seed`; too-long documents are refused or cut (units.py).
2. *Step size*: steps hold `tokens_per_step` tokens within +-10%, decided from the documents and the token budget
   alone (steps.py: the targets; never from the rank speeds).
3. *Cut into steps*: attention-heavy documents are spread over the steps in shuffled order so that every step gets an
   equal share of heavy cost; the light ones fill each step, in shuffled order, up to its token target. Only heavy
   documents move by more than a few positions (`mean_delay_steps` reports it); nothing is sorted by length.
4. *Pack the steps* (packing/): every step at once by a batched LPT (epoch.py) with a batched move/swap search
   (search.py); the steps where it falls short by `pack_step` (step.py: heavy documents one by one, a water-filling
   target per micro-batch, batched LPT of the light ones, a spill to the next step), settled in order (settle.py),
   then, without pipelines, refined replica by replica (refine.py).
5. *Repair*: empty micro-batches take a small document from the fullest one; documents that fit nowhere move to the
   next step; a too-small last step borrows small documents from earlier ones.

Inside each micro-batch, documents keep their shuffled order. With `Topology(cp_sizes=...)` the static plan is the
first stage of dynamic CP (dynamic/).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.dynamic.plan import plan_dynamic
from balancer.planning.metrics import natural_steps, step_times
from balancer.planning.packing.across import move_across
from balancer.planning.packing.epoch import LazySteps, by_micro_batch, pack_light_steps, steps_to_repack
from balancer.planning.packing.refine import refine_packed
from balancer.planning.packing.replicas import permute_replicas
from balancer.planning.packing.settle import Batched, Settling, settle, trade_step_tokens
from balancer.planning.plans.plan import Plan
from balancer.planning.speeds import even, planning_view, token_bound
from balancer.planning.steps import (
    STEP_BAND,
    ShortStepError,
    assign_steps,
    borrow_for_small_steps,
    effective_step_tokens,
    equal_row_cut,
    fixed_step_targets,
    pack_equal_rows,
    step_token_targets,
)
from balancer.planning.topology import Topology
from balancer.planning.units import check_topology_and_cost, planning_units, validate_lengths

ATTN_SHARE = 1 / 3  # a unit is attention-heavy when attention is at least this share of its cost
SLOW_PLAN = 10.0  # seconds: a plan that takes longer is logged (once per process)

log = logging.getLogger(__name__)
_slow_logged = False  # the slow-planning line is logged once per process
_speed_logged: set = set()  # topologies whose speeds want more tokens than a replica holds (logged once each)

__all__ = ["plan"]


def plan(
    lengths: Sequence[int] | np.ndarray,
    topology: Topology,
    cost: CostModel,
    seed: int = 0,
    overflow: str = "error",
    progress: bool = False,
    *,
    num_steps: int | None = None,
    filler_rows: bool = False,
) -> Plan:
    """Plan a whole epoch: every document exactly once, `micro_batches` non-empty micro-batches per replica per step
    (with `topology.cp_sizes`: per slot, a partition of the pool into CP groups, each with a non-empty micro-batch;
    see balancer.planning.dynamic.plan). The last step may run M' < `micro_batches` on every replica when the
    documents cannot fill it (`plan.last_micro_batches`; fixed-length rows: balancer.planning.steps.equal_row_cut).

    `overflow` decides what happens to a document longer than `max_tokens * cp`: "error" (default) raises,
    "split" cuts it into consecutive windows (recorded as spans), "truncate" keeps its first `max_tokens * cp`
    tokens (the rest is counted in `dropped_tokens`). `num_steps`: exactly that many steps (a window's
    `window_step_count`), spread, never an overflow step; None: the planner's own count (with uneven `rank_speeds`: the
    even plan's count, so that speeds never change it). `filler_rows`: fixed-length
    rows that no M' splits equally over the replicas get the fewest loss-masked filler rows that make it split
    (copies of real rows, recorded in the plan as `plan.filler` / `plan.filler_rows`, never documents); without it
    such rows are refused naming the numbers.
    """
    started = time.perf_counter()
    lengths = validate_lengths(lengths)
    check_topology_and_cost(topology, cost)
    _check_num_steps(num_steps)
    if planning_view(topology) is not topology:  # equal speeds: the even plan, recording the speeds
        placed = plan(
            lengths, planning_view(topology), cost, seed, overflow, progress, num_steps=num_steps,
            filler_rows=filler_rows,
        )  # fmt: skip
        placed.topology = topology
        return placed
    if num_steps is None and topology.rank_speeds is not None:
        # uneven ranks: the even plan's count, so that no speeds change it (speed-aware packing of the last step
        # would otherwise open an overflow step for some speeds and not for others)
        num_steps = plan(lengths, even(topology), cost, seed, overflow).num_steps
    if topology.dynamic:
        return plan_dynamic(lengths, topology, cost, seed, overflow, progress, static_plan=plan, num_steps=num_steps)
    _log_if_token_bound(topology)
    u_doc, u_start, u_end = planning_units(lengths, topology.micro_batch_tokens, overflow, topology)
    u_tok = u_end - u_start
    if len(u_doc) < topology.bins_per_step and (num_steps is not None or u_tok.min() != u_tok.max()):
        return _one_short_step(lengths, topology, cost, seed, overflow, len(u_doc), num_steps, started)
    doc_order, shuffled = _shuffle(len(lengths), u_doc, seed)
    u_tok = (u_end - u_start)[shuffled]
    rows, m_last, fillers = _equal_rows(u_tok, topology, num_steps, filler_rows)
    if rows is not None:  # fixed-length rows: whole rows per step, dealt evenly (the last step maybe short)
        shuffled = np.concatenate([shuffled, _filler_units(shuffled, fillers, (u_doc, u_start, u_end), lengths)])
        targets = rows * float(u_tok[0])
        packed = pack_equal_rows(rows, topology, m_last)
        _log_short_step(len(u_tok), topology, m_last, fillers)
    else:
        u_cost = cost.cost(u_tok)
        # only documents whose attention is a large part of their cost need spreading or grouping over the steps;
        # the rest fill the steps by tokens in shuffled order
        attn_heavy = cost.attention_cost(u_tok) >= ATTN_SHARE * u_cost
        targets = _step_targets(u_cost, u_tok, attn_heavy, topology, seed, num_steps)
        rng = np.random.default_rng([seed, 1])
        packed = _pack_epoch(u_cost, u_tok, attn_heavy, targets, topology, rng, progress, fixed=num_steps is not None)
        packed = refine_packed(packed, u_cost, u_tok, topology)
        packed = move_across(packed, u_cost, u_tok, topology)
        packed = permute_replicas(packed, topology, np.random.default_rng([seed, 2]))
    units = (u_doc, u_start, u_end, shuffled, doc_order, u_tok)
    return _assemble(lengths, topology, cost, seed, packed, units, targets, m_last, started)


def _filler_units(shuffled: np.ndarray, fillers: int, units: tuple, lengths) -> np.ndarray:
    """The units the `fillers` filler rows copy: the first whole rows in shuffled order (a filler is read as its
    whole row, so a copy of a cut or truncated row would hold more tokens than its place in the plan)."""
    if not fillers:
        return shuffled[:0]
    u_doc, u_start, u_end = units
    whole = shuffled[(u_start[shuffled] == 0) & (u_end[shuffled] == np.asarray(lengths)[u_doc[shuffled]])]
    if not len(whole):
        raise ValueError(
            f"filler_rows=True: the last step needs {fillers} filler rows, which copy whole rows, but every row is "
            f"cut to {int(u_end[0] - u_start[0])}-token units (rows longer than max_tokens * cp): pass rows that fit, "
            "or leave filler_rows off"
        )
    return whole[np.arange(fillers) % len(whole)]


def _assemble(lengths, topology: Topology, cost, seed, packed: list, units: tuple, targets, m_last, started) -> Plan:
    """The Plan of a packed epoch: placements in micro-batch order, inside a micro-batch whole documents first, then
    spans, then filler rows (units at shuffled positions past the real ones)."""
    u_doc, u_start, u_end, shuffled, doc_order, shuffled_tokens = units
    sizes = np.concatenate([mb_sizes.ravel() for _, mb_sizes in packed])
    position = np.concatenate([positions for positions, _ in packed])
    unit = shuffled[position]
    filler = position >= len(u_doc)
    one_each = len(u_doc) == len(lengths) and np.array_equal(u_end, lengths)  # no document cut or truncated
    whole = one_each or (u_start[unit] == 0) & (u_end[unit] == lengths[u_doc[unit]])
    if not np.all(whole) or filler.any():  # the Plan layout inside a micro-batch
        mb_id = np.repeat(np.arange(len(sizes)), sizes)
        kind = np.where(filler, 2, np.where(np.broadcast_to(whole, unit.shape), 0, 1))
        order = np.argsort(mb_id * 3 + kind, kind="stable")
        unit, filler = unit[order], filler[order]
    placed_tokens = lengths if one_each else np.bincount(u_doc, weights=u_end - u_start, minlength=len(lengths))
    placed_tokens = placed_tokens.astype(np.int64, copy=False)
    _log_if_slow(time.perf_counter() - started, len(lengths), len(sizes) // topology.bins_per_step, topology)
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
        natural_step=partial(
            natural_steps,
            doc_order,
            placed_tokens,
            int(round(float(np.mean(targets)))),
            shuffled_tokens if one_each else None,
        ),  # computed on first use
        plan_seconds=time.perf_counter() - started,
        last_micro_batches=m_last,
        filler=filler if filler.any() else None,
    )


def _check_num_steps(num_steps) -> None:
    if num_steps is not None and (
        isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1
    ):
        raise ValueError(f"num_steps must be a positive integer or None, got {num_steps!r}")


def _step_targets(u_cost, u_tok, attn_heavy, topology: Topology, seed: int, num_steps: int | None) -> np.ndarray:
    """Token targets of the steps: the planner's own count (step size chosen with the cost model) or exactly
    `num_steps`."""
    if num_steps is not None:
        _check_count(num_steps, len(u_tok), topology)
        return fixed_step_targets(int(u_tok.sum()), len(u_tok), int(num_steps), topology)
    # speed-blind: the step count depends on the documents and the token budget, never on the rank speeds
    step_tokens = _choose_step_tokens(u_cost, u_tok, attn_heavy, even(topology), seed)
    # a step must hold at least one document per micro-batch: with tokens_per_step below that (tiny budgets or huge
    # documents) +-10% cannot hold, so steps grow to fit a few documents per micro-batch
    floor = int(1.25 * topology.bins_per_step * u_tok.mean())
    return step_token_targets(int(u_tok.sum()), step_tokens, topology.capacity, topology.tokens_per_step, floor)


def _equal_rows(
    u_tok: np.ndarray, topology: Topology, num_steps: int | None, filler_rows: bool = False
) -> tuple[np.ndarray | None, int, int]:
    """(rows per step, micro-batches of the last step, filler rows) when every unit has the same length:
    `equal_row_cut` (with `filler_rows`, of the rows plus the fewest filler rows that make it split), or with
    `num_steps` the rows dealt evenly over that many steps (None when a step would then hold more rows than its
    micro-batches take: the general packing spreads them); (None, M, 0) for units of different lengths."""
    m = topology.micro_batches
    if u_tok.min() != u_tok.max():
        return None, m, 0
    if num_steps is None:
        try:
            return (*equal_row_cut(len(u_tok), int(u_tok[0]), topology), 0)
        except ShortStepError as e:
            if not filler_rows:
                raise ShortStepError(
                    f"{e}; or pass filler_rows=True (--filler-rows) to add {e.missing} loss-masked filler row(s)",
                    e.missing,
                ) from None
            return (*equal_row_cut(len(u_tok) + e.missing, int(u_tok[0]), topology), e.missing)
    rows = np.full(int(num_steps), len(u_tok) // num_steps, dtype=np.int64)
    rows[: len(u_tok) % num_steps] += 1
    per_step = topology.bins_per_step * (topology.micro_batch_tokens // int(u_tok[0]))
    if rows.min() >= topology.bins_per_step and rows.max() <= per_step:
        return rows, m, 0
    try:  # a window's count with a short last step (balancer.planning.window.step_cut)
        cut, m_last = equal_row_cut(len(u_tok), int(u_tok[0]), topology)
    except ShortStepError:
        return None, m, 0
    return (cut, m_last, 0) if len(cut) == num_steps and m_last < m else (None, m, 0)


def _one_short_step(lengths, topology: Topology, cost, seed, overflow, units: int, num_steps, started) -> Plan:
    """Fewer documents than one step's dp*micro_batches micro-batches: one step of M' = units // dp micro-batches
    on every replica (planned on that topology), or a ShortStepError naming the numbers when units < dp."""
    m_last = units // topology.dp
    if m_last < 1 or num_steps not in (None, 1):
        raise ShortStepError(
            f"{units} documents cannot fill dp*micro_batches = {topology.dp}*{topology.micro_batches} = "
            f"{topology.bins_per_step} non-empty micro-batches"
            + (
                f" (nor one on each of dp = {topology.dp} replicas); lower dp or micro_batches "
                f"(Topology.dp to at most {units})"
                if m_last < 1
                else f" in {num_steps} steps; lower dp or micro_batches"
            ),
            max(0, topology.dp - units),
        )
    small = replace(topology, micro_batches=m_last, tokens_per_step=None)
    small = replace(small, tokens_per_step=min(topology.step_tokens, small.capacity))
    placed = plan(lengths, small, cost, seed, overflow, num_steps=1)
    _log_short_step(units, topology, m_last)
    return Plan(
        placed.lengths, topology, cost, placed.doc, placed.start, placed.end, placed.mb_ptr, seed=seed,
        natural_step=placed.natural_step, plan_seconds=time.perf_counter() - started,
        dropped_tokens=placed.dropped_tokens, last_micro_batches=m_last,
    )  # fmt: skip


def _log_short_step(units: int, topology: Topology, m_last: int, fillers: int = 0) -> None:
    """One INFO line per (units, topology) and process when the last step runs M' < micro_batches micro-batches or
    filler rows were added."""
    key = ("short", units, topology)
    if (m_last < topology.micro_batches or fillers) and key not in _speed_logged:
        _speed_logged.add(key)
        log.info(
            "%d documents cannot fill every step's dp*micro_batches = %d*%d micro-batches: the last step runs %d "
            "micro-batch(es) on every replica (recorded in the plan as last_micro_batches)%s",
            units, topology.dp, topology.micro_batches, m_last,
            f", with {fillers} loss-masked filler row(s) (filler_rows=True)" if fillers else "",
        )  # fmt: skip


def _check_count(num_steps: int, num_units: int, topology: Topology) -> None:
    nb = topology.bins_per_step
    if num_steps * nb > num_units:
        raise ValueError(
            f"num_steps = {num_steps} steps of dp*micro_batches = {nb} non-empty micro-batches need at least "
            f"{num_steps * nb} documents, there are {num_units}"
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
    fixed: bool = False,
) -> list:
    """Cut the shuffled units into steps and pack each; returns the packed epoch as pieces of consecutive steps
    (units sorted by step and micro-batch, [steps, micro-batches] sizes).

    Every step without attention-heavy units is first packed by the batched LPT of balancer.planning.packing.epoch (all
    such steps at once) and polished by the batched local search; a step keeps that packing unless
    `fastpack.steps_to_repack` sends it to `pack_step`, or units moved into it from the step before. `fixed`: exactly
    `len(targets)` steps (no step merged or opened)."""
    nb = topology.bins_per_step
    groups = _cut_steps(u_cost, u_tok, attn_heavy, targets, nb, rng, grouped=topology.pp > 1, fixed=fixed)
    flat = np.concatenate(groups)
    ptr = np.concatenate([[0], np.cumsum([len(g) for g in groups])])
    fast_bin = pack_light_steps(flat, ptr, u_cost, u_tok, attn_heavy, topology)
    if not len(fast_bin) or fast_bin.max() < 0:  # no step packed by the batched LPT (every step holds heavy units)
        none = np.zeros(len(groups), dtype=bool)  # what steps_to_repack finds: every step incomplete, re-packed
        batched = Batched(flat, ptr, np.zeros((len(groups), nb), dtype=np.int64), none, LazySteps(fast_bin, ptr, none))
        return settle(groups, batched, Settling(u_cost, u_tok, attn_heavy, targets, topology, fixed), progress)
    repack, complete = steps_to_repack(fast_bin, u_cost[flat], u_tok[flat], ptr, topology)
    fast = LazySteps(fast_bin, ptr, complete)
    # the good steps' result, sorted by micro-batch (the -1 of incomplete steps sorts first, unused)
    by_bin, sizes = by_micro_batch(flat, ptr, fast_bin, nb)
    batched = Batched(by_bin, ptr, sizes, ready=~repack, fast=fast)
    return settle(groups, batched, Settling(u_cost, u_tok, attn_heavy, targets, topology, fixed), progress)


def _cut_steps(
    u_cost: np.ndarray,
    u_tok: np.ndarray,
    attn_heavy: np.ndarray,
    targets: np.ndarray,
    nb: int,
    rng: np.random.Generator,
    grouped: bool,
    fixed: bool = False,
) -> list[np.ndarray]:
    """The units of every step (`assign_steps`), each step with at least `nb` units, then light units traded
    between neighbours so that steps hold their token targets (`trade_step_tokens`, only where a step is off)."""
    step_of = assign_steps(u_cost, u_tok, targets, nb, rng, grouped=grouped, attn_heavy=attn_heavy)
    if np.all(step_of[1:] >= step_of[:-1]):  # steps cut from the shuffled order as it is (no heavy unit moved)
        by_step, in_step_order = np.arange(len(step_of)), step_of
    else:
        key = step_of.astype(np.int16) if len(targets) < 2**15 else step_of  # 16-bit keys sort by radix
        by_step = np.argsort(key, kind="stable")  # shuffled order kept inside a step
        in_step_order = step_of[by_step]
    bounds = np.searchsorted(in_step_order, np.arange(len(targets) + 1))
    groups = [by_step[bounds[s] : bounds[s + 1]] for s in range(len(targets))]
    borrow_for_small_steps(groups, u_cost, nb, merge=not fixed)
    sizes = np.array([len(g) for g in groups])
    totals = np.zeros(len(groups))
    totals[sizes > 0] = np.add.reduceat(u_tok[np.concatenate(groups)], (np.cumsum(sizes) - sizes)[sizes > 0])
    step_target = targets[np.minimum(np.arange(len(groups)), len(targets) - 1)]
    off = np.flatnonzero(np.abs(totals - step_target) > 0.02 * step_target)
    s = int(off[0]) if len(off) else len(groups)
    tradable = attn_heavy if attn_heavy.any() else None  # None: every unit may be traded
    # step s's token total, kept as units move: exact, since tokens are integers (u_tok is int64) and only the trade
    # at step s changes groups[s + 1], whose total is then its cut's plus what step s passed on
    total = float(totals[s]) if s < len(groups) else 0.0
    while s < len(groups) - 1:  # the steps off their target, and each step the one before traded units with
        before = groups[s + 1]
        groups[s], moved = trade_step_tokens(
            groups[s], groups, s, total, float(step_target[s]), u_tok, tradable, nb
        )  # fmt: skip
        if groups[s + 1] is not before:
            s, total = s + 1, float(totals[s + 1]) + moved
        else:
            k = int(np.searchsorted(off, s + 1))
            s = int(off[k]) if k < len(off) else len(groups)
            total = float(totals[s]) if s < len(groups) else 0.0
    return groups


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
    tps = topology.step_tokens
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


def _log_if_token_bound(topology: Topology) -> None:
    """One log line (INFO, once per process and topology) when the fastest replica cannot hold its speed's share of
    a step's tokens (`speeds.token_bound`): it then gets less than its share of the work (the plan is still valid,
    just slower)."""
    bound = token_bound(topology)
    key = ("token-bound", topology)
    if bound is not None and key not in _speed_logged:
        _speed_logged.add(key)
        log.info(
            "rank_speeds: the fastest replica's share of a step is about %d tokens, but a replica holds %d "
            "(micro_batches*max_tokens*cp); it gets less than its share of the work unless tokens_per_step is lowered "
            "(to about %d) or max_tokens raised",
            *bound,
        )


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
