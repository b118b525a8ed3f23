"""Settling an epoch's steps in order: where the batched packing is good and nothing moved in, a run of steps is
taken as it is; otherwise the step is packed by `pack_step` (the faster of the two is kept), units that fit nowhere
move on to the next step (which then is re-packed too), the step's leftover room is backfilled from the next step,
steps are held near their token targets by trading light units with the next step, and a too-small overflow step
borrows units from earlier ones."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.planning.metrics import one_f_one_b
from balancer.planning.packing.bestfit import best_fit_steps
from balancer.planning.packing.epoch import LazySteps
from balancer.planning.packing.step import fill_empty, pack_step, place_rest, step_time
from balancer.planning.speeds import bin_speeds, replica_speeds
from balancer.planning.topology import Topology

PROGRESS_AFTER = 2.0  # seconds before a progress bar (progress=True) appears
BACKFILL_FLOOR = 0.92  # a step backfills past its time only while it holds under this share of tokens_per_step


@dataclass
class Batched:
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


@dataclass(frozen=True)
class Settling:
    """What settling reads at every step: the units' cost, tokens and attention-heaviness (`u_cost`, `u_tok`,
    `attn_heavy`, one entry per unit), the steps' token `targets`, the `topology`, and whether the step count is
    `fixed`."""

    u_cost: np.ndarray
    u_tok: np.ndarray
    attn_heavy: np.ndarray
    targets: np.ndarray
    topology: Topology
    fixed: bool = False


def settle(groups: list, batched: Batched, job: Settling, progress: bool) -> list:
    """Step by step: take the batched packing (good enough, sorted by micro-batch) where the step is ready and its
    units did not change, a run of ready steps at once; else pack with `pack_step` (keeping the batched packing
    when that is faster), move what fits nowhere on to the next step (which then is re-packed too) and backfill;
    a too-small overflow step borrows from earlier ones. `fixed`: exactly `len(groups)` steps; what the last step
    cannot place is spread over the steps before (`spread_leftovers`), never an overflow step. Returns pieces
    (units by step and micro-batch, [steps, micro-batches] sizes) of consecutive steps."""
    packed: list[tuple[np.ndarray, np.ndarray]] = []
    carry = np.zeros(0, dtype=np.int64)
    s = 0
    bar = _progress(len(groups), progress)
    while s < len(groups) or len(carry):
        if job.fixed and s == len(groups):
            packed = spread_leftovers(packed, carry, job.u_cost, job.u_tok, job.topology)
            break
        if not len(carry) and s + 1 < len(groups) and batched.take(s):
            # the common case: nothing moved in, the batched packing is good (forgetting only ever reaches the
            # step after the one being settled, so the run ends where the first unready step was at the start)
            end = min(int(batched.next_unready[s]), len(groups) - 1)  # the last step may overflow: settled
            packed.append((batched.by_bin[batched.ptr[s] : batched.ptr[end]], batched.sizes[s:end]))
            done = end - s
        else:
            carry = _settle_step(s, carry, groups, batched, packed, job)
            done = 1
        s += done
        if bar:
            bar.update(done)
        if s > 4 * len(groups) + 10:
            raise RuntimeError("planner failed to place all documents (units fit no micro-batch)")
    if bar:
        bar.close()
    return packed


def _settle_step(s: int, carry: np.ndarray, groups: list, batched: Batched, packed: list, job: Settling) -> np.ndarray:
    """Pack step `s` (with the units `carry` moved in from the step before) onto `packed`; returns the units that
    move on to the next step."""
    u_cost, u_tok, attn_heavy, targets, topology, fixed = (
        job.u_cost, job.u_tok, job.attn_heavy, job.targets, job.topology, job.fixed
    )  # fmt: skip
    nb = topology.bins_per_step
    units = groups[s] if s < len(groups) else np.zeros(0, dtype=np.int64)
    unit_bin = batched.fast[s] if s < len(batched.fast) and not len(carry) else None
    units = np.concatenate([carry, units])
    if not fixed and s == len(groups) - 1 and u_tok[units].sum() > 1.1 * targets.max() and len(units) > 2 * nb:
        groups.append(np.zeros(0, dtype=np.int64))  # the last step overflows: open one more
    if unit_bin is None and s + 1 < len(groups):
        target = float(targets[s]) if s < len(targets) else float(targets.max())
        before = groups[s + 1]
        units = hold_step_tokens(units, groups, s, target, u_tok, attn_heavy, nb)
        if groups[s + 1] is not before:  # units moved to or from the next step: its batched packing is stale
            batched.forget(s + 1)
    if len(units) < nb and packed:
        units, unit_bin = _reopen_last_step(packed, units, u_cost, nb), None
    if unit_bin is None or not batched.take(s):
        unit_bin = _faster(unit_bin, pack_step(u_cost[units], u_tok[units], topology), u_cost[units], topology)
    if bin_speeds(topology) is not None and s + 1 >= len(groups) and np.any(unit_bin < 0):
        # uneven ranks: what the last step leaves over stays in it where it fits, rather than opening a step that
        # speed-blind packing would not need (the step count must not depend on the speeds)
        trial = unit_bin.copy()
        place_rest(trial, u_cost[units], u_tok[units], topology)
        fill_empty(trial, u_cost[units], nb)
        if np.bincount(trial[trial >= 0], minlength=nb).min() > 0:  # else carried on as before
            unit_bin = trial
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


def hold_step_tokens(
    units: np.ndarray, groups: list, s: int, target: float, u_tok: np.ndarray, attn_heavy: np.ndarray | None, nb: int
) -> np.ndarray:
    """Step `s`'s units after `trade_step_tokens`, its token total summed here."""
    return trade_step_tokens(units, groups, s, float(u_tok[units].sum()), target, u_tok, attn_heavy, nb)[0]


def trade_step_tokens(
    units: np.ndarray,
    groups: list,
    s: int,
    total: float,
    target: float,
    u_tok: np.ndarray,
    attn_heavy: np.ndarray | None,
    nb: int,
) -> tuple[np.ndarray, float]:
    """Keep step `s` (its `units`, holding `total` tokens) within 2% of its token target by trading light units with
    the next step (in place on `groups[s + 1]`): trailing light units move on when the step is too big, leading
    light units of the next step come forward when it is too small. Units larger than what is left to trade are
    skipped; when the step is still off then, one unit that overshoots the target but lands closer to it is traded.
    Every step keeps at least `nb` units. `attn_heavy` None: no unit of the epoch is attention-heavy (every unit may
    be traded). Returns (step s's units, the tokens it passed on; negative where it took some)."""
    tol = 0.01 * target
    if abs(total - target) <= 2 * tol:
        return units, 0.0
    nxt = groups[s + 1]
    down = total > target  # too big: trailing units move on; too small: leading units of the next step come
    src = units if down else nxt
    pool = np.arange(len(src)) if attn_heavy is None else np.flatnonzero(~attn_heavy[src])
    if down:
        pool, budget, room = pool[::-1], total - target, len(units) - nb
    else:
        budget, room = target - total, len(nxt) - nb
    chosen: list[int] = []
    moved = 0
    for k, t in zip(pool.tolist(), u_tok[src[pool]].tolist()):
        if budget <= tol or len(chosen) >= room:
            break
        if t <= budget + tol:
            chosen.append(k)
            budget -= t
            moved += t
    if budget > 2 * tol and len(chosen) < room:
        # every unit left is larger than the gap (e.g. a step of heavy documents and a few large light ones): trade
        # the one that brings the step closest to its target, overshooting it, when that is closer than now
        rest = np.setdiff1d(pool, chosen, assume_unique=True)
        if len(rest):
            miss = np.abs(u_tok[src[rest]] - budget)
            best = int(np.argmin(miss))
            if miss[best] < budget:
                chosen.append(int(rest[best]))
                moved += int(u_tok[src[rest[best]]])
    if not chosen:
        return units, 0.0
    n, j = len(src), len(chosen)  # `chosen` holds no index twice (the overshoot comes from the rest)
    if down and min(chosen) == n - j:  # so these are exactly the trailing units (the usual trade): slices, no masks
        groups[s + 1] = np.concatenate([units[n - j :], nxt])
        return units[: n - j], float(moved)
    if not down and max(chosen) == j - 1:  # the next step's leading units
        groups[s + 1] = nxt[j:]
        return np.concatenate([units, nxt[:j]]), -float(moved)
    mask = np.zeros(n, dtype=bool)
    mask[chosen] = True
    if down:
        groups[s + 1] = np.concatenate([units[mask], nxt])
        return units[~mask], float(moved)
    groups[s + 1] = nxt[~mask]
    return np.concatenate([units, nxt[mask]]), -float(moved)


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
    step into the leftover room, so the step keeps its size (in place on groups). An empty micro-batch takes one
    first; every other unit goes to the micro-batch where its replica's new time is least; with even ranks and
    pp = 1 backfilling stops when that is the step's slowest replica and the unit would raise the step's time
    (the other replicas are token-full: the pulled units must not pile onto the slowest), unless the step would
    otherwise hold under BACKFILL_FLOOR of tokens_per_step. With pipelines and uneven ranks every unit that fits
    is taken (by tokens alone: with uneven ranks the step count must never depend on the speeds)."""
    nb, cap, m, dp = topology.bins_per_step, topology.micro_batch_tokens, topology.micro_batches, topology.dp
    tok = np.bincount(bins, weights=u_tok[placed], minlength=nb)
    load = np.bincount(bins, weights=u_cost[placed], minlength=nb)
    speeds = replica_speeds(topology)
    speed = np.ones(dp) if speeds is None else speeds
    rep = np.arange(nb) // m
    filled = np.bincount(bins, minlength=nb) > 0
    per = load.reshape(dp, m)
    step_time = float((one_f_one_b(per.max(axis=1), per.sum(axis=1), topology.pp) / speed).max())
    floor = BACKFILL_FLOOR * topology.step_tokens - float(tok.sum())  # tokens the step must still take
    nxt = groups[s + 1]
    cand = np.flatnonzero(~attn_heavy[nxt])
    cand = cand[np.argsort(u_tok[nxt[cand]], kind="stable")]
    taken: list = []  # unit positions (numpy integers)
    new_bins: list[int] = []
    moved = 0.0
    for k in cand:
        if moved >= gap or len(nxt) - len(taken) <= nb:
            break
        u = nxt[k]
        c, t = float(u_cost[u]), float(u_tok[u])
        per = load.reshape(dp, m)
        new_time = one_f_one_b(np.maximum(per.max(axis=1)[rep], load + c), per.sum(axis=1)[rep], topology.pp, c)
        new_time = new_time / speed[rep]
        room = tok + t <= cap
        if not room.any():
            break  # the smallest remaining unit fits nowhere
        if not filled.all() and (room & ~filled).any():
            j = int(np.flatnonzero(room & ~filled)[0])  # an empty micro-batch first
        else:
            j = int(np.argmin(np.where(room, new_time, np.inf)))
            slowest = int(np.argmax(one_f_one_b(per.max(axis=1), per.sum(axis=1), topology.pp) / speed))
            if speeds is None and topology.pp == 1 and rep[j] == slowest and new_time[j] > step_time and moved >= floor:
                break  # only the slowest replica has room: the step is token-bound, the units stay in the next step
        taken.append(k)
        new_bins.append(j)
        tok[j] += t
        load[j] += c
        filled[j] = True
        moved += t
        step_time = max(step_time, float(new_time[j]))
    if not taken:
        return placed, bins
    keep = np.ones(len(nxt), dtype=bool)
    keep[taken] = False
    groups[s + 1] = nxt[keep]
    return np.concatenate([placed, nxt[taken]]), np.concatenate([bins, np.array(new_bins, dtype=np.int64)])


def spread_leftovers(
    packed: list, carry: np.ndarray, u_cost: np.ndarray, u_tok: np.ndarray, topology: Topology
) -> list:
    """A fixed step count: the units its last step could not place go, largest first, each to the micro-batch of
    any step with room for it where it raises its step's 1F1B time least. A unit no micro-batch has room for takes
    the place of smaller units of the micro-batch that frees room with the fewest tokens moved, and those are
    placed again the same way (each move trades a unit for smaller ones, so this ends). Returns the epoch as one
    piece; a RuntimeError when the units cannot all be placed (a count too small for the documents)."""
    nb, cap, m, pp = topology.bins_per_step, topology.micro_batch_tokens, topology.micro_batches, topology.pp
    units = np.concatenate([u for u, _ in packed] + [np.zeros(0, dtype=np.int64)])
    sizes = np.concatenate([sz for _, sz in packed]).ravel()
    mb_of = np.repeat(np.arange(len(sizes)), sizes)
    tok = np.bincount(mb_of, weights=u_tok[units], minlength=len(sizes))
    load = np.bincount(mb_of, weights=u_cost[units], minlength=len(sizes)).reshape(-1, topology.dp, m)
    pending = sorted(carry.tolist(), key=lambda u: (u_tok[u], u))
    placed_mb: dict[int, int] = {}
    tries = 0
    while pending:
        tries += 1
        if tries > 100 * (len(carry) + 10):
            break
        u = pending.pop()
        t, c = float(u_tok[u]), float(u_cost[u])
        replica = (pp - 1) * load.max(axis=2) + load.sum(axis=2)  # [steps, dp]
        step = replica.max(axis=1)
        after = (pp - 1) * np.maximum(load.max(axis=2)[:, :, None], load + c) + (load.sum(axis=2) + c)[:, :, None]
        rise = (np.maximum(after, step[:, None, None]) - step[:, None, None]).ravel()
        rise[tok + t > cap] = np.inf
        k = int(np.argmin(rise))
        if not np.isfinite(rise[k]):
            k, out = _make_room(units, mb_of, placed_mb, tok, u_tok, t, cap)
            if k < 0:
                pending.append(u)
                break
            for v in out:  # smaller units leave micro-batch k and are placed again
                if v in placed_mb:
                    del placed_mb[v]
                else:
                    mb_of[np.flatnonzero(units == v)] = -1
                tok[k] -= u_tok[v]
                load.reshape(-1)[k] -= u_cost[v]
                pending.append(v)
            pending.sort(key=lambda v: (u_tok[v], v))
        placed_mb[u] = k
        tok[k] += t
        load.reshape(-1)[k] += c
    if pending:  # a count the windows prove by best-fit-decreasing packing (balancer.planning.window.packed_cut)
        everything = np.concatenate([units, carry]) if len(carry) else units
        fallback = best_fit_steps(np.unique(everything), u_tok, u_cost, topology, len(sizes) // nb)
        if fallback is not None:
            return fallback
        raise RuntimeError(
            f"the planner could not place {len(pending)} documents in the fixed {len(sizes) // nb} steps (no "
            f"micro-batch of max_tokens*cp = {cap} tokens has room): lower Topology.tokens_per_step"
        )
    keep = mb_of >= 0
    extra = np.array(list(placed_mb), dtype=np.int64)
    all_units = np.concatenate([units[keep], extra])
    all_mb = np.concatenate([mb_of[keep], np.array([placed_mb[u] for u in extra.tolist()], dtype=np.int64)])
    order = np.lexsort((all_units, all_mb))  # by micro-batch, shuffled order inside
    counts = np.bincount(all_mb, minlength=len(sizes)).reshape(-1, nb)
    return [(all_units[order], counts)]


def _make_room(units, mb_of, placed_mb, tok, u_tok, t: float, cap: int) -> tuple[int, list]:
    """The micro-batch where moving out units smaller than `t` frees room for `t` tokens with the fewest tokens
    moved, and those units (largest first); (-1, []) when no micro-batch can."""
    members: dict[int, list] = {}
    for v, k in zip(units[mb_of >= 0].tolist(), mb_of[mb_of >= 0].tolist()):
        members.setdefault(k, []).append(v)
    for v, k in placed_mb.items():
        members.setdefault(k, []).append(v)
    best, best_moved, best_out = -1, np.inf, []
    for k, vs in members.items():
        need = tok[k] + t - cap
        out, moved = [], 0.0
        for v in sorted((v for v in vs if u_tok[v] < t), key=lambda v: -u_tok[v]):
            if moved >= need:
                break
            out.append(v)
            moved += float(u_tok[v])
        if moved >= need and moved < best_moved:
            best, best_moved, best_out = k, moved, out
    return best, best_out


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
        take: list[int] = []
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


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="planning steps", unit="step", delay=PROGRESS_AFTER)
