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

import time
from collections.abc import Sequence

import numpy as np

from .cost import CostModel
from .metrics import lower_bound, natural_steps, step_times
from .plan import Plan
from .topology import Topology

OVERFLOW_POLICIES = ("error", "split", "truncate")
HEAVY_STEP = 0.25  # heavier than this share of a micro-batch's average work: spread evenly over the steps
HEAVY_PACK = 0.5  # heavier than this share of a micro-batch's average work: placed one by one in pack_step
STEP_BAND = (0.93, 1.07)  # step sizes the planner aims for, in tokens_per_step (3% margin to the +-10% rule)
SPREAD_WINDOW = 8  # heavy units are evened out over windows of this many steps (bounds their delay)
GROUP_WINDOW = 32  # with pipelining, heavy units are grouped by cost inside windows of this many steps
ATTN_SHARE = 1 / 3  # a unit is attention-heavy when attention is at least this share of its cost
SPILL_SLACK = 1e-3  # once targets are met, leftovers may raise the step's time by this much, else move on ...
SPILL_MOVE = 0.1  # ... to the next step, up to this share of the step's tokens
POLISH_MAX_UNITS = 64  # steps this small also get a move/swap local search (exact-gap territory) ...
POLISH_ABOVE = 1.005  # ... when their time is this far above the step's lower bound


def validate_lengths(lengths, name: str = "lengths") -> np.ndarray:
    """1-D positive integer lengths as int64, or a ValueError naming the first bad document."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of document lengths, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty: there is nothing to plan")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {arr[i].item()!r} is not an integer token count (document {i})")
    bad = arr <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {arr[i].item()} : document {i} has no tokens (lengths must be >= 1)")
    return arr.astype(np.int64)


def _units(lengths: np.ndarray, cap: int, overflow: str, topology: Topology):
    """Cut documents into planning units (doc, start, end) honouring the overflow policy."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    n = len(lengths)
    over = lengths > cap
    if not over.any():
        return np.arange(n), np.zeros(n, dtype=np.int64), lengths.copy()
    if overflow == "error":
        i = int(np.argmax(lengths * over))
        raise ValueError(
            f"document {i} has {lengths[i]} tokens, more than a micro-batch holds: max_tokens*cp = "
            f"{topology.max_tokens}*{topology.cp} = {cap} ({int(over.sum())} documents are over); raise "
            f"max_tokens or cp, or pass overflow='split' (windows) or 'truncate'"
        )
    if overflow == "truncate":
        return np.arange(n), np.zeros(n, dtype=np.int64), np.minimum(lengths, cap)
    pieces = -(-lengths // cap)
    doc = np.repeat(np.arange(n), pieces)
    first = np.cumsum(pieces) - pieces
    start = (np.arange(len(doc)) - np.repeat(first, pieces)) * cap
    end = np.minimum(start + cap, lengths[doc])
    return doc, start, end


def step_token_targets(
    total_tokens: int, step_tokens: int, capacity: int, tokens_per_step: int | None = None, floor: int = 0
) -> np.ndarray:
    """Token target of every step: equal steps near `step_tokens` when that keeps every step within 7% of
    `tokens_per_step` (default: `step_tokens`; the 3% margin to the 10% rule absorbs packing granularity) and under
    97% of capacity; otherwise full steps of `step_tokens` (at most 97% of capacity, what packing can reach) and a
    smaller last one."""
    tps = step_tokens if tokens_per_step is None else tokens_per_step
    step_tokens = int(min(max(step_tokens, STEP_BAND[0] * tps), STEP_BAND[1] * tps, 0.97 * capacity))
    step_tokens = max(step_tokens, int(min(floor, 0.97 * capacity)), 1)  # room for a document per micro-batch
    base = max(1, int(round(total_tokens / step_tokens)))
    for s in sorted({base, base + 1, max(1, base - 1)}, key=lambda s: abs(total_tokens / s - step_tokens)):
        even = total_tokens / s
        if STEP_BAND[0] * tps <= even <= STEP_BAND[1] * tps and even <= 0.97 * capacity:
            return np.full(s, even)
    s = max(1, int(np.ceil(total_tokens / step_tokens)))
    targets = np.full(s, float(step_tokens))
    targets[-1] = total_tokens - step_tokens * (s - 1)
    return targets


def _effective_step_tokens(c: np.ndarray, tok: np.ndarray, topology: Topology) -> int:
    """Step size in tokens, shrunk (down to STEP_BAND's lower end) when heavy documents need the room to be balanced.

    A heavy document costs more per token than the light ones that fill the other micro-batches, so a balanced
    step needs token room beyond its token count: `excess = cost/rho - tokens` summed over heavy documents, rho
    being the light documents' cost per token. A step can only be balanced if its tokens stay below
    `capacity - excess` (less a little for packing loss); otherwise token-full micro-batches can't reach the
    replicas that hold heavy documents.
    """
    tps, capacity, nb = topology.tokens_per_step, topology.capacity, topology.bins_per_step
    total = float(tok.sum())
    target = float(tps)
    for _ in range(3):
        steps = max(1.0, total / target)
        heavy = c > HEAVY_PACK * c.sum() / (steps * nb)
        if not heavy.any() or heavy.all():
            return tps
        rho = c[~heavy].sum() / tok[~heavy].sum()
        excess = float(np.sum(c[heavy] / rho - tok[heavy])) / steps
        target = float(np.clip(0.98 * capacity - excess, STEP_BAND[0] * tps, tps))
    return max(1, int(round(target)))


def _assign_steps(
    c: np.ndarray,
    tok: np.ndarray,
    targets: np.ndarray,
    bins: int,
    rng: np.random.Generator,
    grouped: bool,
    attn_heavy: np.ndarray,
) -> np.ndarray:
    """Step of each unit (units given in shuffled order); heavy units spread by cost, light ones fill by tokens.

    Every step gets an equal share of the heavy cost. Without pipelining the heavy units keep their shuffled
    order. With pipelining (`grouped`) they are taken heaviest first, so each step holds heavy units of similar
    cost that can share replicas without a pipeline bubble (the idea behind WLB-LLM's outlier queue, but without
    breaking the step's token budget), and these groups go to steps in random order.
    """
    s = len(targets)
    if s == 1:
        return np.zeros(len(c), dtype=np.int64)
    heavy = (c > HEAVY_STEP * c.sum() / (s * bins)) & attn_heavy
    step = np.empty(len(c), dtype=np.int64)
    if heavy.any() and grouped:
        step[heavy] = _group_heavy(np.flatnonzero(heavy), c, tok, targets, bins, rng)
    elif heavy.any():
        step[heavy] = _spread_heavy(np.flatnonzero(heavy), c, tok, targets)
    heavy_tok = np.bincount(step[heavy], weights=tok[heavy], minlength=s)
    budget = np.maximum(targets - heavy_tok, 0.0)
    lt = tok[~heavy].astype(np.float64)
    before = np.cumsum(lt) - lt
    step[~heavy] = np.minimum(np.searchsorted(np.cumsum(budget), before, side="right"), s - 1)
    return step


def _windows(idx: np.ndarray, tok: np.ndarray, targets: np.ndarray, window: int):
    """Group heavy units (positions `idx` in shuffled order) by the window of `window` steps they naturally fall in.
    Yields (first step, end step, member positions) per non-empty window."""
    s = len(targets)
    ends = np.cumsum(targets)
    natural = np.minimum(np.searchsorted(ends, (np.cumsum(tok) - tok)[idx], side="right"), s - 1)
    win = natural // window
    cuts = np.flatnonzero(np.diff(win)) + 1
    for members, w in zip(np.split(np.arange(len(idx)), cuts), win[np.concatenate([[0], cuts])] if len(idx) else []):
        lo = int(w) * window
        hi = min(lo + window, s)
        if hi - lo > 1 and targets[hi - 1] < 0.9 * targets[lo]:
            hi -= 1  # keep heavy units off a small last step
        yield lo, hi, members


def _spread_heavy(
    idx: np.ndarray, c: np.ndarray, tok: np.ndarray, targets: np.ndarray, window: int = SPREAD_WINDOW
) -> np.ndarray:
    """Heavy units to steps, window by window (windows of `window` steps bound how far a unit moves).

    Inside a window the `window` heaviest units anchor one step each; the other heavy units go, heaviest first, to
    the step furthest below a share of the window's heavy cost proportional to its anchor. A step whose heaviest
    document is big then also carries more work, so that document does not stall it (its replica's fair share
    `W_s / dp` stays above the document's cost).
    """
    out = np.empty(len(idx), dtype=np.int64)
    for lo, hi, members in _windows(idx, tok, targets, window):
        k = hi - lo
        mc = c[idx[members]]
        order = members[np.argsort(-mc, kind="stable")]
        anchors = np.sort(order[:k])  # in shuffled order, one per step
        steps = np.arange(lo, lo + len(anchors))
        out[anchors] = steps
        load = np.zeros(k)
        load[: len(anchors)] = c[idx[anchors]]
        share = load / load.sum() * c[idx[members]].sum()
        for i in order[k:]:
            j = int(np.argmax(share - load))
            out[i] = lo + j
            load[j] += c[idx[i]]
    return out


def _group_heavy(
    idx: np.ndarray,
    c: np.ndarray,
    tok: np.ndarray,
    targets: np.ndarray,
    bins: int,
    rng: np.random.Generator,
    window: int = GROUP_WINDOW,
) -> np.ndarray:
    """Pipelined plans: inside each window of steps, heavy units, heaviest first, form groups of one per
    micro-batch (`bins`) of similar cost, each within 90% of a step's tokens; groups go to the window's steps in
    random order (wrapping round when there are more groups than steps)."""
    out = np.empty(len(idx), dtype=np.int64)
    limit = 0.9 * float(np.median(targets))
    for lo, hi, members in _windows(idx, tok, targets, window):
        order = members[np.argsort(-c[idx[members]], kind="stable")]
        group = np.empty(len(order), dtype=np.int64)
        g, count, used = 0, 0, 0.0
        for k, i in enumerate(order):
            t = tok[idx[i]]
            if count and (count == bins or used + t > limit):
                g, count, used = g + 1, 0, 0.0
            group[k] = g
            count += 1
            used += t
        slots = lo + rng.permutation(hi - lo)
        out[order] = slots[group % (hi - lo)]
    return out


def _water_fill(loads: np.ndarray, work: float, pp: int) -> np.ndarray:
    """Deficits [dp, M] so that adding `work` in those amounts leaves every replica at the same 1F1B time.

    A replica whose micro-batches cost b_1..b_M (largest h) takes light work up to a level l on every
    micro-batch below l; its time is (P-1)*max(h, l) + sum_j max(b_j, l). We solve for the common time T by
    bisection, with each replica's level inverted exactly from its piecewise-linear time curve.
    """
    dp, m = loads.shape
    if work <= 0:
        return np.zeros_like(loads)
    srt = np.sort(loads, axis=1)
    h = srt[:, -1]
    k = np.arange(1, m + 1, dtype=np.float64)
    suffix = srt.sum(axis=1, keepdims=True) - np.cumsum(srt, axis=1)  # sum of the bins above the k-th
    curve = (pp - 1) * h[:, None] + k * srt + suffix  # time when level = k-th smallest
    rows = np.arange(dp)

    def levels(t: float) -> np.ndarray:
        kk = (curve <= t).sum(axis=1)
        idx = np.maximum(kk - 1, 0)
        lvl = (t - (pp - 1) * h - suffix[rows, idx]) / np.maximum(kk, 1)
        lvl = np.where(kk == m, t / (pp - 1 + m), lvl)
        return np.where(kk == 0, -np.inf, lvl)

    def room(t: float) -> float:
        return float(np.maximum(levels(t)[:, None] - loads, 0.0).sum())

    lo, hi = float(curve[:, 0].min()), float(curve[:, -1].max() + work * (pp - 1 + m) / m + work)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if room(mid) < work:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return np.maximum(levels(hi)[:, None] - loads, 0.0)


def pack_step(cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> np.ndarray:
    """Assign one step's units to its `dp * micro_batches` micro-batches.

    `cost[i]`, `tokens[i]`: unit i's cost and token count. Returns the micro-batch index (replica * M + m) of each
    unit, or -1 for units that fit in no micro-batch of this step (the caller moves them to the next step).
    With pipeline stages (P > 1) two placements of the heavy units are tried (spread by marginal bubble, or
    shared to minimise the sum of the replicas' largest micro-batches) and the faster step is kept.
    """
    cost = np.asarray(cost, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if topology.pp == 1:
        best = _pack(cost, tokens, topology, share_heavy=False)
    else:
        best, best_t = None, np.inf
        for share in (False, True):
            assign = _pack(cost, tokens, topology, share_heavy=share)
            t = _step_time(assign, cost, topology)
            if t < best_t:
                best, best_t = assign, t
    if len(cost) <= POLISH_MAX_UNITS and np.all(best >= 0):
        if _step_time(best, cost, topology) > POLISH_ABOVE * float(lower_bound(cost.sum(), cost.max(), topology)):
            _polish(best, cost, tokens, topology)
    return best


def _polish(assign: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology, rounds: int = 30) -> None:
    """Local search for small steps (in place): the best single move or swap of a unit of the slowest replica,
    repeated while it lowers the step time. Each round is vectorised over the candidate partners."""
    t = topology
    m, pp, cap, nb, dp = t.micro_batches, t.pp, t.micro_batch_tokens, t.bins_per_step, t.dp
    rep_of_bin = np.arange(nb) // m
    for _ in range(rounds):
        load = np.bincount(assign, weights=cost, minlength=nb)
        tok = np.bincount(assign, weights=tokens, minlength=nb)
        cnt = np.bincount(assign, minlength=nb)
        lb = load.reshape(dp, m)
        srt = np.sort(lb, axis=1)
        top, second = srt[:, -1], (srt[:, -2] if m > 1 else np.zeros(dp))
        total = lb.sum(axis=1)
        times = (pp - 1) * top + total
        r0 = int(np.argmax(times))
        current = times[r0]
        # the largest replica time outside replicas r0 and x, for every x
        order = np.argsort(-times, kind="stable")
        first_other = times[order[1]] if dp > 1 else -np.inf
        second_other = times[order[2]] if dp > 2 else -np.inf
        rest = np.where(np.arange(dp) == order[min(1, dp - 1)], second_other, first_other)
        # per bin: the largest other bin of its replica
        other_max = np.where(load == top[rep_of_bin], second[rep_of_bin], top[rep_of_bin])
        best, best_val = None, current * (1 - 1e-9)
        rep_unit = assign // m
        for i in np.flatnonzero(rep_unit == r0):
            a, c = assign[i], cost[i]
            t0_move = (pp - 1) * max(other_max[a], load[a] - c) + total[r0] - c
            # moves to every micro-batch of another replica
            ok = (rep_of_bin != r0) & (tok + tokens[i] <= cap) & (cnt[a] > 1)
            tr = (pp - 1) * np.maximum(top[rep_of_bin], load + c) + total[rep_of_bin] + c
            val = np.maximum(np.maximum(t0_move, tr), rest[rep_of_bin])
            val = np.where(ok, val, np.inf)
            j = int(np.argmin(val))
            if val[j] < best_val:
                best, best_val = ("move", i, j), val[j]
            if pp > 1 and cnt[a] > 1:  # inside the replica: lowers its largest micro-batch
                for j in range(r0 * m, (r0 + 1) * m):
                    if j != a and tok[j] + tokens[i] <= cap:
                        b = load[r0 * m : (r0 + 1) * m].copy()
                        b[a - r0 * m] -= c
                        b[j - r0 * m] += c
                        v = max((pp - 1) * b.max() + total[r0], first_other)
                        if v < best_val:
                            best, best_val = ("move", i, j), v
            # swaps with every unit of another replica
            k_idx = np.flatnonzero(rep_unit != r0)
            if len(k_idx):
                ck, bk = cost[k_idx], assign[k_idx]
                fit = (tok[a] - tokens[i] + tokens[k_idx] <= cap) & (tok[bk] - tokens[k_idx] + tokens[i] <= cap)
                t0 = (pp - 1) * np.maximum(other_max[a], load[a] - c + ck) + total[r0] - c + ck
                tk = (pp - 1) * np.maximum(other_max[bk], load[bk] - ck + c) + total[rep_of_bin[bk]] - ck + c
                val = np.where(fit, np.maximum(np.maximum(t0, tk), rest[rep_of_bin[bk]]), np.inf)
                q = int(np.argmin(val))
                if val[q] < best_val:
                    best, best_val = ("swap", i, int(k_idx[q])), val[q]
        if best is None:
            return
        if best[0] == "move":
            assign[best[1]] = best[2]
        else:
            _, i, k = best
            assign[i], assign[k] = assign[k], assign[i]


def _step_time(assign: np.ndarray, cost: np.ndarray, topology: Topology) -> float:
    placed = assign >= 0
    mb = np.bincount(assign[placed], weights=cost[placed], minlength=topology.bins_per_step)
    mb = mb.reshape(1, topology.dp, topology.micro_batches)
    # unplaced units count as a penalty: they will slow a later step
    return float(step_times(mb, topology)[0] + cost[~placed].sum())


def _pack(cost: np.ndarray, tokens: np.ndarray, topology: Topology, share_heavy: bool) -> np.ndarray:
    t = topology
    dp, m, pp, cap = t.dp, t.micro_batches, t.pp, t.micro_batch_tokens
    nb = dp * m
    n = len(cost)
    load = np.zeros(nb)
    tok = np.zeros(nb, dtype=np.int64)
    assign = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return assign
    # largest first; a stable sort, so ties come out in the same order on every machine (unstable SIMD sorts
    # may order float ties differently on another CPU, and every rank must compute the same plan)
    order = np.argsort(-cost, kind="stable")
    avg = cost.sum() / nb
    n_heavy = int(np.sum(cost > HEAVY_PACK * avg))
    rep = np.arange(nb) // m
    if share_heavy:
        _place_heavy_pipelined(order[:n_heavy], cost, tokens, load, tok, assign, topology, float(cost.sum()))
    for i in order[:n_heavy]:
        if assign[i] >= 0:
            continue
        lb = load.reshape(dp, m)
        new_t = (pp - 1) * np.maximum(lb.max(axis=1)[rep], load + cost[i]) + lb.sum(axis=1)[rep] + cost[i]
        new_t[tok + tokens[i] > cap] = np.inf
        j = int(np.lexsort((load, new_t))[0])
        if np.isfinite(new_t[j]):
            assign[i], load[j], tok[j] = j, load[j] + cost[i], tok[j] + tokens[i]

    light = order[n_heavy:]
    deficit = _water_fill(load.reshape(dp, m), float(cost[light].sum()), pp).ravel()
    may_move = SPILL_MOVE * float(tokens.sum())  # tokens of this step that may move on to the next one
    a = 0
    while a < len(light):
        # one round: the next-largest units go to the micro-batches furthest below target, largest to neediest
        positive = int(np.count_nonzero(deficit > 0))
        if positive == 0:  # every target met: the rest may only fill in below the step's time
            _spill(light[a:], cost, tokens, load, tok, assign, topology, may_move)
            break
        k = min(len(light) - a, positive)
        chunk = light[a : a + k]
        a += k
        # largest units are also the densest (cost per token grows with length): send them to the micro-batches
        # that must gain the most cost per token of room left, so token-full micro-batches still reach target
        need = np.where(deficit > 0, deficit / np.maximum(cap - tok, 1), deficit)
        bins = np.argsort(-need, kind="stable")[:k]
        fits = tok[bins] + tokens[chunk] <= cap
        ok_units, ok_bins = chunk[fits], bins[fits]
        assign[ok_units] = ok_bins  # bins are distinct within a round
        deficit[ok_bins] -= cost[ok_units]
        load[ok_bins] += cost[ok_units]
        tok[ok_bins] += tokens[ok_units]
        for i in chunk[~fits]:  # the matched micro-batch is full; take the neediest one that fits
            room = np.where((tok + tokens[i] <= cap) & (deficit > 0), deficit, -np.inf)
            j = int(np.argmax(room))
            if np.isfinite(room[j]):
                assign[i], deficit[j], load[j], tok[j] = j, deficit[j] - cost[i], load[j] + cost[i], tok[j] + tokens[i]
            else:
                may_move = _spill(np.array([i]), cost, tokens, load, tok, assign, topology, may_move)
    _fill_empty(assign, cost, nb)
    return assign


def _place_heavy_pipelined(
    heavy: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    load: np.ndarray,
    tok: np.ndarray,
    assign: np.ndarray,
    topology: Topology,
    work: float,
) -> None:
    """Heavy units with P > 1 stages: share replicas where that costs no extra pipeline bubble (in place).

    When all replicas finish together at time T, replica r runs `T - (P-1) h_r` of work (h_r its largest
    micro-batch), so `T = (W + (P-1) * sum_r h_r) / dp`: the plan is best when the sum of the replicas' largest
    micro-batches is smallest. Units come largest first; a unit joins a replica that already holds a larger one
    (in a micro-batch that stays <= h_r) while that replica still has room under T, and opens a new replica only
    when none has. Units left unplaced go to the marginal greedy.
    """
    t = topology
    dp, m, pp, cap = t.dp, t.micro_batches, t.pp, t.micro_batch_tokens
    h = np.zeros(dp)
    s = np.zeros(dp)
    hsum, k = 0.0, 0
    for i in heavy:
        c = cost[i]
        level = (work + (pp - 1) * hsum) / (dp - (pp - 1) * (dp - k) / (pp - 1 + m))
        bl, bt = load.reshape(dp, m), tok.reshape(dp, m)
        ok_bin = (bl + c <= h[:, None] * (1 + 1e-12)) & (bt + tokens[i] <= cap) & (h[:, None] > 0)
        slack = level - (pp - 1) * h - s
        ok_rep = ok_bin.any(axis=1) & (slack >= c)
        if ok_rep.any():
            r = int(np.argmax(np.where(ok_rep, slack, -np.inf)))
            j = r * m + int(np.argmin(np.where(ok_bin[r], bl[r], np.inf)))
        elif k < dp:
            r = int(np.argmin(h))
            j = r * m
            h[r] = c
            hsum += c
            k += 1
        else:
            return
        assign[i], load[j], tok[j] = j, load[j] + c, tok[j] + tokens[i]
        s[r] += c


def _spill(
    units: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    load: np.ndarray,
    tok: np.ndarray,
    assign: np.ndarray,
    topology: Topology,
    may_move: float,
) -> float:
    """Place units once every micro-batch has met its target: each goes where it raises its replica's time least,
    but only while the step's time stays within SPILL_SLACK of what it is; the others stay unplaced (the caller
    moves them to the next step, which keeps token-full steps from piling their overflow on one replica), as long
    as `may_move` tokens allow. Returns the tokens that may still move."""
    t = topology
    dp, m, pp, cap = t.dp, t.micro_batches, t.pp, t.micro_batch_tokens
    rep = np.arange(dp * m) // m
    lb = load.reshape(dp, m)
    top, total = lb.max(axis=1), lb.sum(axis=1)
    limit = float(((pp - 1) * top + total).max()) * (1 + SPILL_SLACK)
    for i in units:
        new_t = (pp - 1) * np.maximum(top[rep], load + cost[i]) + total[rep] + cost[i]
        new_t[tok + tokens[i] > cap] = np.inf
        j = int(np.argmin(new_t))
        if new_t[j] <= limit or (np.isfinite(new_t[j]) and tokens[i] > may_move):
            assign[i], load[j], tok[j] = j, load[j] + cost[i], tok[j] + tokens[i]
            r = j // m
            top[r], total[r] = max(top[r], load[j]), total[r] + cost[i]
            limit = max(limit, float(new_t[j]))
        else:
            may_move -= tokens[i]
    return may_move


def _fill_empty(assign: np.ndarray, cost: np.ndarray, nb: int) -> None:
    """Give every empty micro-batch the cheapest unit of the micro-batch with the most units (in place)."""
    placed = assign >= 0
    counts = np.bincount(assign[placed], minlength=nb)
    for j in np.flatnonzero(counts == 0):
        donor = int(np.argmax(counts))
        if counts[donor] < 2:
            return  # not enough units: the caller sees the empty micro-batch
        members = np.flatnonzero(assign == donor)
        i = members[np.argmin(cost[members])]
        assign[i] = j
        counts[donor] -= 1
        counts[j] += 1


def plan(
    lengths: Sequence[int] | np.ndarray,
    topology: Topology,
    cost: CostModel,
    seed: int = 0,
    overflow: str = "error",
    progress: bool = False,
) -> Plan:
    """Plan a whole epoch: every document exactly once, `micro_batches` non-empty micro-batches per replica per step.

    `overflow` decides what happens to a document longer than `max_tokens * cp`: "error" (default) raises,
    "split" cuts it into consecutive windows (recorded as spans), "truncate" keeps its first `max_tokens * cp`
    tokens (the rest is counted in `dropped_tokens`).
    """
    t0 = time.perf_counter()
    lengths = validate_lengths(lengths)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a balancer.Topology, got {type(topology).__name__}")
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a balancer.CostModel, got {type(cost).__name__}")
    nb = topology.bins_per_step
    u_doc, u_start, u_end = _units(lengths, topology.micro_batch_tokens, overflow, topology)
    if len(u_doc) < nb:
        raise ValueError(
            f"{len(u_doc)} documents cannot fill dp*micro_batches = {topology.dp}*"
            f"{topology.micro_batches} = {nb} non-empty micro-batches; lower dp or micro_batches"
        )
    rng = np.random.default_rng(seed)
    doc_order = rng.permutation(len(lengths))
    if len(u_doc) == len(lengths):  # units in shuffled document order
        shuffled = doc_order
    else:
        rank = np.empty_like(doc_order)
        rank[doc_order] = np.arange(len(doc_order))
        shuffled = np.argsort(rank[u_doc], kind="stable")
    u_tok = (u_end - u_start)[shuffled]
    u_cost = cost.cost(u_tok)
    # only documents whose attention is a large part of their cost need spreading or grouping over the steps;
    # the rest fill the steps by tokens in shuffled order
    attn_heavy = (u_cost - cost.linear_coef * u_tok) >= ATTN_SHARE * u_cost
    step_tokens = _choose_step_tokens(u_cost, u_tok, attn_heavy, topology, seed)
    # a step must hold at least one document per micro-batch: with tokens_per_step below that (tiny budgets or
    # huge documents) +-10% cannot hold, so steps grow to fit a few documents per micro-batch
    floor = int(1.25 * nb * u_tok.mean())
    targets = step_token_targets(int(u_tok.sum()), step_tokens, topology.capacity, topology.tokens_per_step, floor)
    packed = _pack_epoch(u_cost, u_tok, attn_heavy, targets, topology, np.random.default_rng([seed, 1]), progress)

    sizes = np.concatenate([sz for _, sz in packed])
    unit = shuffled[np.concatenate([u for u, _ in packed])]
    whole = (u_start[unit] == 0) & (u_end[unit] == lengths[u_doc[unit]])
    if not whole.all():  # inside a micro-batch: whole documents first, then spans (the Plan layout)
        mb_id = np.repeat(np.arange(len(sizes)), sizes)
        unit = unit[np.argsort(mb_id * 2 + ~whole, kind="stable")]
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    placed_tokens = np.bincount(u_doc, weights=u_end - u_start, minlength=len(lengths)).astype(np.int64)
    natural = natural_steps(doc_order, placed_tokens, int(round(float(np.mean(targets)))))
    return Plan(
        lengths,
        topology,
        cost,
        u_doc[unit],
        u_start[unit],
        u_end[unit],
        ptr,
        seed=seed,
        natural_step=natural,
        plan_seconds=time.perf_counter() - t0,
    )


def _pack_epoch(
    u_cost: np.ndarray,
    u_tok: np.ndarray,
    attn_heavy: np.ndarray,
    targets: np.ndarray,
    topology: Topology,
    rng: np.random.Generator,
    progress: bool = False,
) -> list:
    """Cut the shuffled units into steps and pack each; returns per step (units sorted by micro-batch, sizes)."""
    nb = topology.bins_per_step
    step_of = _assign_steps(u_cost, u_tok, targets, nb, rng, grouped=topology.pp > 1, attn_heavy=attn_heavy)
    key = step_of.astype(np.int16) if len(targets) < 2**15 else step_of  # 16-bit keys sort by radix
    by_step = np.argsort(key, kind="stable")  # shuffled order kept inside a step
    bounds = np.searchsorted(step_of[by_step], np.arange(len(targets) + 1))
    groups = [by_step[bounds[s] : bounds[s + 1]] for s in range(len(targets))]
    _borrow_for_small_tail(groups, u_cost, nb)

    packed: list[tuple[np.ndarray, np.ndarray]] = []  # per step: units sorted by micro-batch, micro-batch sizes
    carry = np.zeros(0, dtype=np.int64)
    s = 0
    bar = _progress(len(groups), progress)
    while s < len(groups) or len(carry):
        units = groups[s] if s < len(groups) else np.zeros(0, dtype=np.int64)
        units = np.concatenate([carry, units])
        if s == len(groups) - 1 and u_tok[units].sum() > 1.1 * targets.max() and len(units) > 2 * nb:
            groups.append(np.zeros(0, dtype=np.int64))  # the last step overflows: open one more
        if s + 1 < len(groups):
            target = float(targets[s]) if s < len(targets) else float(targets.max())
            units = _hold_step_tokens(units, groups, s, target, u_tok, attn_heavy, nb)
        if len(units) < nb and packed:
            units = _reopen_last_step(packed, units, u_cost, nb)
        assign = pack_step(u_cost[units], u_tok[units], topology)
        carry = units[assign < 0]
        placed = units[assign >= 0]
        bins = assign[assign >= 0]
        if len(carry) and s + 1 < len(groups):
            placed, bins = _backfill(
                placed, bins, float(u_tok[carry].sum()), groups, s, u_tok, u_cost, attn_heavy, topology
            )
        srt = np.argsort(bins * len(u_cost) + placed)  # by micro-batch, shuffled order inside (unique keys)
        packed.append((placed[srt], np.bincount(bins, minlength=nb)))
        s += 1
        if bar:
            bar.update(1)
        if s > 4 * len(groups) + 10:
            raise RuntimeError("planner failed to place all documents (units fit no micro-batch)")
    if bar:
        bar.close()
    return packed


def _hold_step_tokens(
    units: np.ndarray, groups: list, s: int, target: float, u_tok: np.ndarray, attn_heavy: np.ndarray, nb: int
) -> np.ndarray:
    """Keep step `s` within 2% of its token target by trading light units with the next step (in place on
    `groups[s + 1]`): trailing light units move on when the step is too big, leading light units of the next step
    come forward when it is too small. Units larger than what is left to trade are skipped."""
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
    for k in pool:
        if budget <= tol or len(chosen) >= room:
            break
        t = u_tok[src[k]]
        if t <= budget + tol:
            chosen.append(k)
            budget -= t
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
    total = 0.0
    for units, sizes in packed:
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        per_mb = np.where(sizes > 0, np.add.reduceat(np.append(u_cost[units], 0.0), starts), 0.0)
        total += float(step_times(per_mb.reshape(1, topology.dp, topology.micro_batches), topology)[0])
    return total


def _choose_step_tokens(
    u_cost: np.ndarray, u_tok: np.ndarray, attn_heavy: np.ndarray, topology: Topology, seed: int
) -> int:
    """Step size in tokens, inside STEP_BAND around `tokens_per_step`.

    Two forces pull on it: heavy documents need token room beyond their tokens (smaller steps, see
    `_effective_step_tokens`), and a document whose cost exceeds a replica's share of its step stalls that step
    (bigger steps). When they disagree, both sizes are tried on a sample of the epoch (the first ~12 steps of the
    shuffled order) and the faster one is kept.
    """
    tps = topology.tokens_per_step
    shrunk = _effective_step_tokens(u_cost, u_tok, topology)
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


def _borrow_for_small_tail(groups: list[np.ndarray], u_cost: np.ndarray, nb: int) -> None:
    """Make every step hold at least `nb` units (in place).

    A too-small last step borrows the cheapest units of the step before when that one can spare them; any other
    too-small step (documents large against the step size) is merged into its neighbour.
    """
    if len(groups) > 1 and len(groups[-1]) < nb and len(groups[-2]) - (nb - len(groups[-1])) >= nb:
        prev = groups[-2]
        take = np.argsort(u_cost[prev], kind="stable")[: nb - len(groups[-1])]
        keep = np.ones(len(prev), dtype=bool)
        keep[take] = False
        groups[-1] = np.sort(np.concatenate([prev[take], groups[-1]]))
        groups[-2] = prev[keep]
    s = 0
    while s < len(groups) and len(groups) > 1:
        if len(groups[s]) >= nb:
            s += 1
            continue
        other = s + 1 if s + 1 < len(groups) else s - 1
        groups[min(s, other)] = np.sort(np.concatenate([groups[s], groups[other]]))
        del groups[max(s, other)]
        s = min(s, other)


def _reopen_last_step(packed: list, units: np.ndarray, u_cost: np.ndarray, nb: int) -> np.ndarray:
    """An overflow step too small to fill every micro-batch borrows the cheapest units of earlier steps (latest
    first), never emptying one of their micro-batches (in place on `packed`)."""
    borrowed = [units]
    need = nb - len(units)
    for back in range(len(packed) - 1, -1, -1):
        if need <= 0:
            break
        flat, sizes = packed[back]
        mb_of = np.repeat(np.arange(nb), sizes)
        left = sizes.copy()
        take = []
        for k in np.argsort(u_cost[flat], kind="stable"):
            if len(take) == need:
                break
            if left[mb_of[k]] > 1:
                left[mb_of[k]] -= 1
                take.append(k)
        keep = np.ones(len(flat), dtype=bool)
        keep[take] = False
        packed[back] = (flat[keep], left)
        borrowed.append(np.sort(flat[take]))
        need -= len(take)
    if need > 0:
        raise ValueError(
            f"cannot give every one of the {nb} micro-batches of the last step a document: the "
            "documents are too large for the step size; raise max_tokens or lower micro_batches"
        )
    return np.concatenate(borrowed)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="planning steps", unit="step")
