"""Packing one step: documents to the `dp * micro_batches` micro-batches so that the replicas' 1F1B times
`(P-1) * max_m t_m + sum_m t_m` come out equal (heavy units one by one, a water-filling target for the rest,
batched LPT rounds of light units, and a spill rule for what fits nowhere). With uneven ranks
(`Topology.rank_speeds`) a replica's time is its 1F1B time divided by its speed, in every one of these moves."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.planning.metrics import lower_bound, one_f_one_b, step_times
from balancer.planning.packing.order import largest_first
from balancer.planning.packing.search import polish
from balancer.planning.packing.waterfill import water_fill
from balancer.planning.speeds import bin_speeds, planning_view, replica_speeds
from balancer.planning.steps import HEAVY_PACK
from balancer.planning.topology import Topology

SPILL_SLACK = 1e-3  # once targets are met, leftovers may raise the step's time by this much, else move on ...
SPILL_MOVE = 0.1  # ... to the next step, up to this share of the step's tokens
POLISH_MAX_UNITS = 64  # steps this small also get a move/swap local search (exact-gap territory) ...
POLISH_ABOVE = 1.005  # ... when their time is this far above the step's lower bound
FEW_BINS = 16  # steps of at most this many micro-batches deal their light units on Python floats
SORT_AT_MOST = 128  # least_then_cheapest sorts up to this many micro-batches (16: a sort 1.7 us, three calls 5.7 us)


@dataclass
class _Bins:
    """Placement state of one step: per-micro-batch cost and tokens, and each unit's micro-batch (-1: unplaced)."""

    cost: np.ndarray  # [dp * M] summed unit cost per micro-batch
    tokens: np.ndarray  # [dp * M] summed unit tokens per micro-batch
    unit_bin: np.ndarray  # [units] micro-batch index (replica * M + m), -1 while unplaced
    replica_of_bin: np.ndarray  # [dp * M]

    @classmethod
    def empty(cls, units: int, topology: Topology) -> _Bins:
        nb = topology.bins_per_step
        return cls(
            np.zeros(nb),
            np.zeros(nb, dtype=np.int64),
            np.full(units, -1, dtype=np.int64),
            np.arange(nb) // topology.micro_batches,
        )

    def place(self, unit: int, bin_index: int, cost: float, tokens: int) -> None:
        self.unit_bin[unit] = bin_index
        self.cost[bin_index] += cost
        self.tokens[bin_index] += tokens


def pack_step(cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> np.ndarray:
    """Assign one step's units to its `dp * micro_batches` micro-batches.

    `cost[i]`, `tokens[i]`: unit i's cost and token count. Returns the micro-batch index (replica * M + m) of each
    unit, or -1 for units that fit in no micro-batch of this step (the caller moves them to the next step).
    With pipeline stages (P > 1) two placements of the heavy units are tried (spread by marginal bubble, or
    shared to minimise the sum of the replicas' largest micro-batches) and the faster step is kept.
    """
    cost = np.asarray(cost, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    topology = planning_view(topology)
    if topology.pp == 1:
        best = _pack(cost, tokens, topology, share_heavy=False)
    else:
        candidates = [_pack(cost, tokens, topology, share_heavy=share) for share in (False, True)]
        best = min(candidates, key=lambda unit_bin: step_time(unit_bin, cost, topology))  # the first on a tie
    if len(cost) <= POLISH_MAX_UNITS and np.all(best >= 0):
        if step_time(best, cost, topology) > POLISH_ABOVE * float(lower_bound(cost.sum(), cost.max(), topology)):
            polish(best, cost, tokens, topology)
    return best


def step_time(unit_bin: np.ndarray, cost: np.ndarray, topology: Topology) -> float:
    """The step's time (section-3 model) for units placed in micro-batches `unit_bin`; every unplaced unit adds
    its cost as a penalty (it will slow a later step; with uneven ranks divided by the mean speed, a time too)."""
    placed = unit_bin >= 0
    mb = np.bincount(unit_bin[placed], weights=cost[placed], minlength=topology.bins_per_step)
    mb = mb.reshape(1, topology.dp, topology.micro_batches)
    penalty = cost[~placed].sum()
    speeds = replica_speeds(topology)
    if speeds is not None:
        penalty = penalty / speeds.mean()
    return float(step_times(mb, topology)[0] + penalty)


def _pack(cost: np.ndarray, tokens: np.ndarray, topology: Topology, share_heavy: bool) -> np.ndarray:
    """One packing of a step: heavy units (over HEAVY_PACK of a micro-batch's average) first, then the rest."""
    bins = _Bins.empty(len(cost), topology)
    if len(cost) == 0:
        return bins.unit_bin
    # largest first; a stable sort, so ties come out in the same order on every machine (unstable SIMD sorts
    # may order float ties differently on another CPU, and every rank must compute the same plan)
    order = largest_first(cost, tokens)
    n_heavy = int(np.sum(cost > HEAVY_PACK * (cost.sum() / topology.bins_per_step)))
    if share_heavy:
        _place_heavy_pipelined(order[:n_heavy], cost, tokens, bins, topology, float(cost.sum()))
    _place_heavy_marginal(order[:n_heavy], cost, tokens, bins, topology)
    _place_light(order[n_heavy:], cost, tokens, bins, topology)
    if replica_speeds(topology) is not None:  # a slow replica's micro-batch may be left empty with units spilled
        _fill_empty_from_spilled(bins, cost, tokens, topology)
    fill_empty(bins.unit_bin, cost, topology.bins_per_step)
    return bins.unit_bin


def _fill_empty_from_spilled(bins: _Bins, cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> None:
    """Every empty micro-batch takes the cheapest unplaced unit that fits it (in place), before any unit moves on
    to the next step."""
    cap = topology.micro_batch_tokens
    for j in np.flatnonzero(np.bincount(bins.unit_bin[bins.unit_bin >= 0], minlength=topology.bins_per_step) == 0):
        left = np.flatnonzero((bins.unit_bin < 0) & (tokens <= cap - bins.tokens[j]))
        if len(left):
            i = int(left[np.argmin(cost[left])])
            bins.place(i, int(j), cost[i], tokens[i])


def _place_heavy_marginal(
    heavy: np.ndarray, cost: np.ndarray, tokens: np.ndarray, bins: _Bins, topology: Topology
) -> None:
    """Each heavy unit not yet placed goes to the micro-batch that least raises its replica's 1F1B time (ties:
    the cheaper micro-batch)."""
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    rep = bins.replica_of_bin
    speed = bin_speeds(topology)
    if topology.pp == 1 and speed is None:
        _place_heavy_sums(heavy[bins.unit_bin[heavy] < 0], cost, tokens, bins, topology)
        return
    for i in heavy:
        if bins.unit_bin[i] >= 0:
            continue
        per_replica = bins.cost.reshape(dp, m)
        if topology.pp == 1:  # the 1F1B time without stages: the replica's sum, whichever micro-batch takes it
            new_time = per_replica.sum(axis=1)[rep] + cost[i]
        else:
            new_time = one_f_one_b(
                np.maximum(per_replica.max(axis=1)[rep], bins.cost + cost[i]),
                per_replica.sum(axis=1)[rep],
                topology.pp,
                cost[i],
            )
        if speed is not None:
            new_time = new_time / speed
        new_time[bins.tokens + tokens[i] > cap] = np.inf
        j = least_then_cheapest(new_time, bins.cost)
        if j >= 0:
            bins.place(i, j, cost[i], tokens[i])


def _place_heavy_sums(heavy: np.ndarray, cost: np.ndarray, tokens: np.ndarray, bins: _Bins, topology: Topology) -> None:
    """`_place_heavy_marginal` without stages or speeds, on Python floats (the same placement): a replica's time is
    its sum, so each unit goes to the least-loaded replica with room (ties: the cheaper micro-batch with room, then
    the first), as the per-micro-batch table picks. A replica's sum is re-read with NumPy's own reduction after each
    placement, so the floats compared are the table's. With no negative cost the scan of tied replicas stops at an
    empty-cost micro-batch with room (none is cheaper): at a step's start every replica ties at zero."""
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    if not len(heavy):
        return
    per_replica = bins.cost.reshape(dp, m)
    rep_sum = per_replica.sum(axis=1).tolist()
    rep_low = bins.tokens.reshape(dp, m).min(axis=1).tolist()  # a replica has room for t when its emptiest has
    bin_cost, bin_tok = bins.cost.tolist(), bins.tokens.tolist()
    floor = 0.0 if min(bin_cost) >= 0 and float(cost[heavy].min()) >= 0 else -float("inf")  # nothing is cheaper
    inf = float("inf")
    for i, c, t in zip(heavy.tolist(), cost[heavy].tolist(), tokens[heavy].tolist()):
        limit = cap - t
        open_sum = [total if low <= limit else inf for low, total in zip(rep_low, rep_sum)]
        least = min(open_sum)
        if least == inf:
            continue
        best = least + c  # the least new time (adding c keeps the order of the sums)
        j, cheapest = -1, inf
        for r in [r for r, total in enumerate(open_sum) if total + c == best]:
            for b in range(r * m, r * m + m):
                if bin_tok[b] <= limit and bin_cost[b] < cheapest:
                    j, cheapest = b, bin_cost[b]
            if cheapest <= floor:
                break
        if j < 0:
            continue
        bins.place(i, j, c, t)
        r = j // m
        bin_cost[j], bin_tok[j] = float(bins.cost[j]), int(bins.tokens[j])
        rep_sum[r] = float(per_replica[r].sum())
        rep_low[r] = min(bin_tok[r * m : r * m + m])


def least_then_cheapest(time: np.ndarray, bin_cost: np.ndarray) -> int:
    """The micro-batch of least finite `time` (ties: the cheaper, then the first), -1 when none is finite: what
    `np.lexsort((bin_cost, time))[0]` picks, without sorting the many micro-batches of a large step (a sort is
    cheaper than the three NumPy calls below for few)."""
    if len(time) <= SORT_AT_MOST:
        j = int(np.lexsort((bin_cost, time))[0])
        return j if np.isfinite(time[j]) else -1
    best = time.min()
    if not np.isfinite(best):
        return -1
    ties = np.flatnonzero(time == best)
    return int(ties[np.argmin(bin_cost[ties])]) if len(ties) > 1 else int(ties[0])


def _place_light(light: np.ndarray, cost: np.ndarray, tokens: np.ndarray, bins: _Bins, topology: Topology) -> None:
    """Light units, largest first, in rounds to the micro-batches furthest below their water-filling target."""
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    deficit = water_fill(
        bins.cost.reshape(dp, m), float(cost[light].sum()), topology.pp, replica_speeds(topology)
    ).ravel()
    may_move = SPILL_MOVE * float(tokens.sum())  # tokens of this step that may move on to the next one
    limit = None  # the step time spilled units may reach, set at the first spill (then only what is reached)

    def spill(units: np.ndarray) -> None:
        nonlocal may_move, limit
        may_move, limit = _spill(units, cost, tokens, bins, topology, may_move, limit)

    rounds = _rounds_few_bins if len(deficit) <= FEW_BINS else _rounds
    done = rounds(light, cost, tokens, bins, deficit, cap, spill, uneven=replica_speeds(topology) is not None)
    if done < len(light):  # every target met: the rest may only fill in below the step's time
        spill(light[done:])


def _rounds(light, cost, tokens, bins: _Bins, deficit: np.ndarray, cap: int, spill, uneven: bool = False) -> int:
    """Deal `light` in rounds while some micro-batch is below target (in place); returns how many were dealt.

    `uneven` (uneven ranks: a slow replica's targets are small): a round stops at the first micro-batch whose
    deficit is below half the unit it would get (it would overshoot its target by more than it gains); the next
    round deals smaller units."""
    done = 0
    while done < len(light):
        # one round: the next-largest units go to the micro-batches furthest below target, largest to neediest
        below = np.flatnonzero(deficit > 0)
        if len(below) == 0:
            break
        k = min(len(light) - done, len(below))
        chunk = light[done : done + k]
        done += k
        # largest units are also the densest (cost per token grows with length): send them to the micro-batches
        # that must gain the most cost per token of room left, so token-full micro-batches still reach target
        # (k <= the micro-batches below target, so only they are ranked; ties in index order)
        need = deficit[below] / np.maximum(cap - bins.tokens[below], 1)
        targets = below[np.argsort(-need, kind="stable")[:k]]
        if uneven:
            k = _round_size(deficit[targets], cost[chunk])
            done += k - len(chunk)
            chunk, targets = chunk[:k], targets[:k]
        chunk_tok = tokens[chunk]
        fits = bins.tokens[targets] + chunk_tok <= cap
        every = bool(fits.all())  # the usual round: no copies of the chunk
        ok_units, ok_bins = (chunk, targets) if every else (chunk[fits], targets[fits])
        ok_cost = cost[ok_units]
        bins.unit_bin[ok_units] = ok_bins  # micro-batches are distinct within a round
        deficit[ok_bins] -= ok_cost
        bins.cost[ok_bins] += ok_cost
        bins.tokens[ok_bins] += chunk_tok if every else chunk_tok[fits]
        for i in () if every else chunk[~fits]:  # the matched micro-batch is full; take the neediest one that fits
            _misfit(i, cost, tokens, bins, deficit, cap, spill)
    return done


def _round_size(deficit: np.ndarray, unit_cost: np.ndarray) -> int:
    """How many of a round's (unit, micro-batch) pairs to deal: up to the first whose deficit is below half its
    unit's cost, at least one."""
    short = deficit < 0.5 * unit_cost
    return max(1, int(np.argmax(short))) if short.any() else len(deficit)


def _rounds_few_bins(
    light, cost, tokens, bins: _Bins, deficit: np.ndarray, cap: int, spill, uneven: bool = False
) -> int:
    """`_rounds` on Python floats, for steps of few micro-batches (many rounds of a few units each, where NumPy's
    per-call cost dominates); the same arithmetic and tie-breaks, so the same placement."""
    need_of, cost_of, room_of = deficit.tolist(), bins.cost.tolist(), (cap - bins.tokens).tolist()
    unit_cost, unit_tokens = cost[light].tolist(), tokens[light].tolist()
    bin_of = [-1] * len(light)  # written to bins.unit_bin at the end (a misfit is placed by _misfit itself)
    order = range(len(need_of))
    done, misfits = 0, []
    while done < len(light):
        need = [d / (r if r > 1 else 1) if d > 0 else d for d, r in zip(need_of, room_of)]
        positive = sum(1 for d in need_of if d > 0)
        if positive == 0:
            break
        k = min(len(light) - done, positive)
        # most needy first, ties in index order: np.argsort(-need, kind="stable") (reverse keeps sorted stable)
        targets = sorted(order, key=need.__getitem__, reverse=True)[:k]
        if uneven:  # as in _rounds: stop at the first micro-batch that would overshoot by more than half the unit
            short = [q for q, j in enumerate(targets) if need_of[j] < 0.5 * unit_cost[done + q]]
            k = max(1, short[0]) if short else k
            targets = targets[:k]
        for i, j in zip(range(done, done + k), targets):
            if unit_tokens[i] <= room_of[j]:
                bin_of[i] = j
                need_of[j] -= unit_cost[i]
                cost_of[j] += unit_cost[i]
                room_of[j] -= unit_tokens[i]
            else:
                misfits.append(i)
        done += k
        if misfits:  # rare: back to the arrays for the neediest micro-batch that fits
            deficit[:], bins.cost[:], bins.tokens[:] = need_of, cost_of, [cap - r for r in room_of]
            for i in misfits:
                _misfit(light[i], cost, tokens, bins, deficit, cap, spill)
            need_of, cost_of, room_of = deficit.tolist(), bins.cost.tolist(), (cap - bins.tokens).tolist()
            misfits = []
    deficit[:], bins.cost[:], bins.tokens[:] = need_of, cost_of, [cap - r for r in room_of]
    placed = np.array(bin_of, dtype=np.int64)
    bins.unit_bin[light[placed >= 0]] = placed[placed >= 0]
    return done


def _misfit(i: int, cost, tokens, bins: _Bins, deficit: np.ndarray, cap: int, spill) -> None:
    """Unit `i`'s matched micro-batch is full: the neediest one that fits takes it, else it spills."""
    room = np.where((bins.tokens + tokens[i] <= cap) & (deficit > 0), deficit, -np.inf)
    j = int(np.argmax(room))
    if np.isfinite(room[j]):
        deficit[j] -= cost[i]
        bins.place(i, j, cost[i], tokens[i])
    else:
        spill(np.array([i]))


def _place_heavy_pipelined(
    heavy: np.ndarray, cost: np.ndarray, tokens: np.ndarray, bins: _Bins, topology: Topology, work: float
) -> None:
    """Heavy units with P > 1 stages: share replicas where that costs no extra pipeline bubble (in place).

    When all replicas finish together at time T, replica r runs `T - (P-1) h_r` of work (h_r its largest
    micro-batch), so `T = (W + (P-1) * sum_r h_r) / dp`: the plan is best when the sum of the replicas' largest
    micro-batches is smallest. Units come largest first; a unit joins a replica that already holds a larger one
    (in a micro-batch that stays <= h_r) while that replica still has room under T, and opens a new replica only
    when none has. Units left unplaced go to the marginal greedy.

    With uneven ranks replica r runs `T * s_r - (P-1) h_r`, so `T = (W + (P-1) * sum_r h_r) / sum_r s_r`
    (unopened replicas counting `h_r = T * s_r / (P-1+M)`), and a new replica opened is the fastest unopened one.
    """
    dp, m, pp, cap = topology.dp, topology.micro_batches, topology.pp, topology.micro_batch_tokens
    speeds = replica_speeds(topology)
    largest = np.zeros(dp)  # h_r: the largest heavy micro-batch of each opened replica
    heavy_work = np.zeros(dp)  # heavy cost placed on each replica
    largest_sum, opened = 0.0, 0
    unopened_speed = 0.0 if speeds is None else float(speeds.sum())
    for i in heavy:
        c = cost[i]
        bin_cost, bin_tokens = bins.cost.reshape(dp, m), bins.tokens.reshape(dp, m)
        ok_bin = (bin_cost + c <= largest[:, None] * (1 + 1e-12)) & (bin_tokens + tokens[i] <= cap)
        ok_bin &= largest[:, None] > 0
        if speeds is None:
            level = (work + (pp - 1) * largest_sum) / (dp - (pp - 1) * (dp - opened) / (pp - 1 + m))
            slack = level - (pp - 1) * largest - heavy_work
        else:
            level = (work + (pp - 1) * largest_sum) / (speeds.sum() - (pp - 1) * unopened_speed / (pp - 1 + m))
            slack = level * speeds - (pp - 1) * largest - heavy_work
        ok_rep = ok_bin.any(axis=1) & (slack >= c)
        if ok_rep.any():
            r = int(np.argmax(np.where(ok_rep, slack, -np.inf)))
            j = r * m + int(np.argmin(np.where(ok_bin[r], bin_cost[r], np.inf)))
        elif opened < dp:
            r = int(np.argmin(largest)) if speeds is None else int(np.argmax(np.where(largest > 0, -np.inf, speeds)))
            if speeds is not None:
                unopened_speed -= float(speeds[r])
            j = r * m
            largest[r] = c
            largest_sum += c
            opened += 1
        else:
            return
        bins.place(i, j, c, tokens[i])
        heavy_work[r] += c


def _spill(
    units: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    bins: _Bins,
    topology: Topology,
    may_move: float,
    limit: float | None = None,
) -> tuple[float, float]:
    """Place units once every micro-batch has met its target: each goes where it raises its replica's time least,
    but only while the step's time stays within SPILL_SLACK of what it was at the step's first spill (`limit`,
    None at the first call); the others stay unplaced (the caller moves them to the next step, which keeps
    token-full steps from piling their overflow on one replica), as long as `may_move` tokens allow. The limit is
    anchored (even ranks, pp = 1), not re-derived at every call: hundreds of one-unit spills (a step whose other
    replicas are token-full) would each add SPILL_SLACK. Returns the tokens that may still move and the limit."""
    dp, m, pp, cap = topology.dp, topology.micro_batches, topology.pp, topology.micro_batch_tokens
    rep = bins.replica_of_bin
    per_replica = bins.cost.reshape(dp, m)
    largest, total = per_replica.max(axis=1), per_replica.sum(axis=1)
    speeds, speed = replica_speeds(topology), bin_speeds(topology)
    now = one_f_one_b(largest, total, pp)
    reached = float((now if speeds is None else now / speeds).max())
    # uneven ranks keep the limit re-derived at every call: what spills decides the step count, which must not
    # depend on the speeds (the uneven paths keep their own rule for the last step, settle.py)
    anchored = limit is not None and speeds is None and pp == 1  # measured on pp = 1; pipelines keep the old rule
    limit = max(limit, reached) if anchored and limit is not None else reached * (1 + SPILL_SLACK)
    for i in units:
        new_time = one_f_one_b(np.maximum(largest[rep], bins.cost + cost[i]), total[rep], pp, cost[i])
        if speed is not None:
            new_time = new_time / speed
        new_time[bins.tokens + tokens[i] > cap] = np.inf
        j = int(np.argmin(new_time))
        if new_time[j] <= limit or (np.isfinite(new_time[j]) and tokens[i] > may_move):
            bins.place(i, j, cost[i], tokens[i])
            r = j // m
            largest[r], total[r] = max(largest[r], bins.cost[j]), total[r] + cost[i]
            limit = max(limit, float(new_time[j]))
        else:
            may_move -= tokens[i]
    return may_move, limit


def place_rest(unit_bin: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> bool:
    """Place the unplaced units (in place), largest first, each where the new 1F1B time of its replica (divided by
    its speed with uneven ranks) is least (ties: the cheaper micro-batch), within the token cap. False when one fits
    nowhere (the units placed before it stay placed)."""
    dp, m, nb, cap = topology.dp, topology.micro_batches, topology.bins_per_step, topology.micro_batch_tokens
    placed = unit_bin >= 0
    bin_cost = np.bincount(unit_bin[placed], weights=cost[placed], minlength=nb)
    bin_tok = np.bincount(unit_bin[placed], weights=tokens[placed], minlength=nb)
    rep = np.arange(nb) // m
    speed = bin_speeds(topology)
    for i in np.flatnonzero(~placed)[np.argsort(-cost[~placed], kind="stable")]:
        per = bin_cost.reshape(dp, m)
        new = one_f_one_b(np.maximum(per.max(axis=1)[rep], bin_cost + cost[i]), per.sum(axis=1)[rep], topology.pp)
        new = new + cost[i]
        if speed is not None:
            new = new / speed
        new[bin_tok + tokens[i] > cap] = np.inf
        j = least_then_cheapest(new, bin_cost)
        if j < 0:
            return False
        unit_bin[i] = j
        bin_cost[j] += cost[i]
        bin_tok[j] += tokens[i]
    return True


def fill_empty(unit_bin: np.ndarray, cost: np.ndarray, nb: int) -> None:
    """Give every empty micro-batch the cheapest unit of the micro-batch with the most units (in place)."""
    placed = unit_bin >= 0
    counts = np.bincount(unit_bin[placed], minlength=nb)
    for j in np.flatnonzero(counts == 0):
        donor = int(np.argmax(counts))
        if counts[donor] < 2:
            return  # not enough units: the caller sees the empty micro-batch
        members = np.flatnonzero(unit_bin == donor)
        i = members[np.argmin(cost[members])]
        unit_bin[i] = j
        counts[donor] -= 1
        counts[j] += 1
