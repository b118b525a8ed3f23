"""Cutting an epoch's shuffled units into steps: token targets per step, and the spreading (or, with pipeline
stages, grouping) of heavy units so every step gets an equal share of heavy cost."""

from __future__ import annotations

import numpy as np

from balancer.planning.topology import Topology

HEAVY_STEP = 0.25  # heavier than this share of a micro-batch's average work: spread evenly over the steps
HEAVY_PACK = 0.5  # heavier than this share of a micro-batch's average work: placed one by one in pack_step
STEP_BAND = (0.93, 1.07)  # step sizes the planner aims for, in tokens_per_step (3% margin to the +-10% rule)
SPREAD_WINDOW = 8  # heavy units are evened out over windows of this many steps (bounds their delay)
GROUP_WINDOW = 32  # with pipelining, heavy units are grouped by cost inside windows of this many steps


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


def fixed_step_count(
    total_tokens: int, num_units: int, big_units: int, rows_per_step: int | None, topology: Topology
) -> int:
    """The step count of a window from its planning units alone: their token total, their number, how many are over
    half a micro-batch (`big_units`: no two share one) and, when all have the same length, the most of them a step
    holds (`rows_per_step`: fixed-length rows that fill a micro-batch unevenly need more steps than their tokens).
    Never the cost model or rank speeds, so every rank knows every window's count before planning it
    (`len(sampler)`), and the planner fills exactly that many steps.

    Steps near `tokens_per_step` (`step_token_targets`, with room for a few units per micro-batch), a micro-batch for
    every big unit, a step for every `rows_per_step` rows, at most `num_units // (dp * micro_batches)` (none empty).
    With dynamic CP the caller passes `count_topology`'s topology."""
    nb = topology.bins_per_step
    if num_units < nb:
        raise ValueError(
            f"{num_units} documents cannot fill dp*micro_batches = {topology.dp}*{topology.micro_batches} = {nb} "
            "non-empty micro-batches; lower dp or micro_batches"
        )
    floor = int(1.25 * nb * total_tokens / num_units)
    tps = topology.step_tokens
    steps = len(step_token_targets(total_tokens, tps, topology.capacity, tps, floor))
    steps = max(steps, -(-big_units // nb), -(-num_units // rows_per_step) if rows_per_step else 1)
    return max(1, min(steps, num_units // nb))


def fixed_step_targets(total_tokens: int, num_units: int, steps: int, topology: Topology) -> np.ndarray:
    """Token targets of exactly `steps` steps (`fixed_step_count`'s count): `step_token_targets`' cut when it has
    that many steps, otherwise equal steps."""
    tps, nb = topology.step_tokens, topology.bins_per_step
    floor = int(1.25 * nb * total_tokens / num_units)
    targets = step_token_targets(total_tokens, tps, topology.capacity, tps, floor)
    return targets if len(targets) == steps else np.full(steps, total_tokens / steps)


def unit_stats(unit_tokens: np.ndarray, cap: int) -> tuple[int, int, int, int, int]:
    """(token total, units, units over half of `cap`, shortest, longest): what a window's step count is computed
    from (balancer.planning.window.step_count)."""
    big = int(np.count_nonzero(2 * np.asarray(unit_tokens) > cap))
    return int(unit_tokens.sum()), len(unit_tokens), big, int(unit_tokens.min()), int(unit_tokens.max())


def effective_step_tokens(unit_cost: np.ndarray, unit_tokens: np.ndarray, topology: Topology) -> int:
    """Step size in tokens, shrunk (down to STEP_BAND's lower end) when heavy documents need the room to be balanced.

    A heavy document costs more per token than the light ones that fill the other micro-batches, so a balanced
    step needs token room beyond its token count: `excess = cost/rho - tokens` summed over heavy documents, rho
    being the light documents' cost per token. A step can only be balanced if its tokens stay below
    `capacity - excess` (less a little for packing loss); otherwise token-full micro-batches can't reach the
    replicas that hold heavy documents.
    """
    tps, capacity, nb = topology.step_tokens, topology.capacity, topology.bins_per_step
    total, total_cost = float(unit_tokens.sum()), float(unit_cost.sum())
    target = float(tps)
    for _ in range(3):
        steps = max(1.0, total / target)
        heavy = unit_cost > HEAVY_PACK * total_cost / (steps * nb)
        count = int(np.count_nonzero(heavy))
        if count == 0 or count == len(heavy):
            return tps
        heavy_cost, heavy_tokens = float(unit_cost.sum(where=heavy)), float(unit_tokens.sum(where=heavy))
        light_cost_per_token = (total_cost - heavy_cost) / (total - heavy_tokens)
        if not light_cost_per_token > 0:  # the light units' cost vanishes beside the heavy ones (float rounding)
            return tps
        excess = (heavy_cost / light_cost_per_token - heavy_tokens) / steps
        before, target = target, float(np.clip(0.98 * capacity - excess, STEP_BAND[0] * tps, tps))
        if target == before:  # a fixed point: the next round would repeat this one
            break
    return max(1, int(round(target)))


def assign_steps(
    unit_cost: np.ndarray,
    unit_tokens: np.ndarray,
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
    num_steps = len(targets)
    if num_steps == 1:
        return np.zeros(len(unit_cost), dtype=np.int64)
    heavy = (unit_cost > HEAVY_STEP * unit_cost.sum() / (num_steps * bins)) & attn_heavy if attn_heavy.any() else None
    if heavy is None or not heavy.any():  # every unit fills the steps by tokens, in shuffled order
        return _fill_by_tokens(unit_tokens, targets)
    step = np.empty(len(unit_cost), dtype=np.int64)
    if heavy.any() and grouped:
        step[heavy] = _group_heavy(np.flatnonzero(heavy), unit_cost, unit_tokens, targets, bins, rng)
    elif heavy.any():
        step[heavy] = _spread_heavy(np.flatnonzero(heavy), unit_cost, unit_tokens, targets)
    heavy_tokens = np.bincount(step[heavy], weights=unit_tokens[heavy], minlength=num_steps)
    budget = np.maximum(targets - heavy_tokens, 0.0)
    step[~heavy] = _fill_by_tokens(unit_tokens[~heavy], budget)
    return step


def _fill_by_tokens(tokens: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """Step of each unit (in the given order) when steps take `budget[s]` tokens one after another: a unit goes to
    the step that holds most of it (its middle), the last step taking the rest."""
    middle = np.cumsum(tokens, dtype=np.float64) - tokens / 2
    return np.minimum(_steps_passed(np.cumsum(budget, dtype=np.float64), middle), len(budget) - 1)


def _steps_passed(ends: np.ndarray, middle: np.ndarray) -> np.ndarray:
    """`np.searchsorted(ends, middle, side="right")` (how many step ends are at or below each unit's middle) for a
    non-decreasing `middle` (tokens are never negative): the few ends are searched among the many units instead."""
    first = np.searchsorted(middle, ends, side="left")  # the first unit at or past each end
    return np.cumsum(np.bincount(first, minlength=len(middle) + 1)[: len(middle)])


def _windows(idx: np.ndarray, unit_tokens: np.ndarray, targets: np.ndarray, window: int):
    """Group heavy units (positions `idx` in shuffled order) by the window of `window` steps they naturally fall in.
    Yields (first step, end step, member positions) per non-empty window."""
    num_steps = len(targets)
    ends = np.cumsum(targets)
    before = (np.cumsum(unit_tokens) - unit_tokens)[idx]
    natural = np.minimum(np.searchsorted(ends, before, side="right"), num_steps - 1)
    win = natural // window
    cuts = np.flatnonzero(np.diff(win)) + 1
    firsts = win[np.concatenate([[0], cuts])] if len(idx) else []
    for members, first in zip(np.split(np.arange(len(idx)), cuts), firsts):
        lo = int(first) * window
        hi = min(lo + window, num_steps)
        if hi - lo > 1 and targets[hi - 1] < 0.9 * targets[lo]:
            hi -= 1  # keep heavy units off a small last step
        yield lo, hi, members


def _spread_heavy(
    idx: np.ndarray, unit_cost: np.ndarray, unit_tokens: np.ndarray, targets: np.ndarray, window: int = SPREAD_WINDOW
) -> np.ndarray:
    """Heavy units to steps, window by window (windows of `window` steps bound how far a unit moves).

    Inside a window the `window` heaviest units anchor one step each; the other heavy units go, heaviest first, to
    the step furthest below a share of the window's heavy cost proportional to its anchor. A step whose heaviest
    document is big then also carries more work, so that document does not stall it (its replica's fair share
    `W_s / dp` stays above the document's cost).
    """
    out = np.empty(len(idx), dtype=np.int64)
    for lo, hi, members in _windows(idx, unit_tokens, targets, window):
        k = hi - lo
        order = members[np.argsort(-unit_cost[idx[members]], kind="stable")]
        anchors = np.sort(order[:k])  # in shuffled order, one per step
        steps = np.arange(lo, lo + len(anchors))
        out[anchors] = steps
        load = np.zeros(k)
        load[: len(anchors)] = unit_cost[idx[anchors]]
        share = load / load.sum() * unit_cost[idx[members]].sum()
        for i in order[k:]:
            j = int(np.argmax(share - load))
            out[i] = lo + j
            load[j] += unit_cost[idx[i]]
    return out


def _group_heavy(
    idx: np.ndarray,
    unit_cost: np.ndarray,
    unit_tokens: np.ndarray,
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
    for lo, hi, members in _windows(idx, unit_tokens, targets, window):
        order = members[np.argsort(-unit_cost[idx[members]], kind="stable")]
        group = np.empty(len(order), dtype=np.int64)
        current, count, used = 0, 0, 0.0
        for k, i in enumerate(order):
            tokens = unit_tokens[idx[i]]
            if count and (count == bins or used + tokens > limit):
                current, count, used = current + 1, 0, 0.0
            group[k] = current
            count += 1
            used += tokens
        slots = lo + rng.permutation(hi - lo)
        out[order] = slots[group % (hi - lo)]
    return out


def equal_row_steps(num_rows: int, row_tokens: int, topology: Topology) -> np.ndarray:
    """Rows per step when every planning unit has the same length (fixed-length rows, e.g. a corpus pretokenized
    with a maximum length): whole rows per step, as close to `tokens_per_step` as the topology allows
    (`equal_row_cut`'s rows; the last step may be a short one)."""
    return equal_row_cut(num_rows, row_tokens, topology)[0]


def equal_row_cut(num_rows: int, row_tokens: int, topology: Topology) -> tuple[np.ndarray, int]:
    """(rows per step, micro-batches of the last step) for fixed-length rows.

    A step needs at least one row per micro-batch (`dp * micro_batches`, none empty) and at most what its
    micro-batches hold (`max_tokens * cp // row_tokens` rows each). Like `step_token_targets`: equal steps when
    they stay within 7% of `tokens_per_step`, else full steps and a smaller last one; when no step size in the
    allowed range is within 7% of `tokens_per_step` (it asks for fewer rows than micro-batches, or more than
    they hold), the rows are spread evenly over the steps. When no cut into such steps exists (a count that is not
    a multiple of dp*micro_batches with one row per micro-batch, or fewer rows than one step's micro-batches), the
    last step runs M' < micro_batches micro-batches on every replica (`short_last_step`); a `ShortStepError` with
    the numbers when not even that splits the rows equally over the replicas.
    """
    t, nb = topology, topology.bins_per_step
    per_mb = t.micro_batch_tokens // row_tokens
    low, high = nb, nb * per_mb  # rows a step may hold
    fewest, most = -(-num_rows // high), num_rows // low  # step counts that keep every step within [low, high]
    if fewest > most:
        return short_last_step(num_rows, per_mb, topology, row_tokens)
    target = t.step_tokens / row_tokens  # rows
    full = int(np.clip(round(target), low, high))

    def in_band(rows: float) -> bool:
        return abs(rows / target - 1) <= STEP_BAND[1] - 1

    def even(steps: int) -> np.ndarray:
        rows = np.full(steps, num_rows // steps, dtype=np.int64)
        rows[: num_rows % steps] += 1
        return rows

    m = t.micro_batches
    base = max(1, round(num_rows / full))
    for steps in sorted({base - 1, base, base + 1}, key=lambda s: abs(num_rows / max(s, 1) - full)):
        if fewest <= steps <= most and in_band(num_rows / steps):
            return even(steps), m
    if in_band(full):  # full steps and a smaller last one, which borrows rows when it has fewer than `low`
        rows = np.full(-(-num_rows // full), full, dtype=np.int64)
        rows[-1] = num_rows - full * (len(rows) - 1)
        donors = np.flatnonzero(rows[:-1] > low)[::-1]  # one row from each step before, latest first
        take = donors[: max(0, low - rows[-1])]
        rows[take] -= 1
        rows[-1] += len(take)
        if rows[-1] >= low:
            return rows, m
    return even(int(np.clip(base, fewest, most))), m


class ShortStepError(ValueError):
    """Rows that no step cut can split equally over the DP replicas (`short_last_step`). `missing`: the fewest
    rows more that would make a cut exist."""

    def __init__(self, message: str, missing: int) -> None:
        super().__init__(message)
        self.missing = missing


def short_last_step(num_rows: int, per_mb: int, topology: Topology, row_tokens: int = 0) -> tuple[np.ndarray, int]:
    """(rows per step, M') for `num_rows` rows that whole steps cannot take: as many full steps as hold them
    (`dp * micro_batches * per_mb` rows each), and a last step of the rest on M' = min(rest // dp,
    micro_batches - 1) micro-batches on every replica, none empty. A ShortStepError naming the numbers and the
    arguments that fix it when the rest cannot be split so: fewer rows than dp, or, with one row per micro-batch,
    a rest that is not a multiple of dp (never a row dropped or repeated to make it fit)."""
    t, nb = topology, topology.bins_per_step
    high = nb * per_mb
    full = num_rows // high
    rest = num_rows - full * high
    m_last = min(rest // t.dp, t.micro_batches - 1)
    if m_last >= 1 and rest <= t.dp * m_last * per_mb:
        return np.array([high] * full + [rest], dtype=np.int64), m_last
    missing = t.dp - rest if rest < t.dp else -rest % t.dp
    if full == 0 and rest < t.dp:
        raise ShortStepError(
            f"{num_rows} rows{f' of {row_tokens} tokens' if row_tokens else ''} cannot give each of dp = {t.dp} "
            f"replicas a micro-batch (no step runs with an empty replica); lower Topology.dp to at most {num_rows}",
            missing,
        )
    wider = f" to {-(-(per_mb + 1) * row_tokens // t.cp)}" if row_tokens else ""
    raise ShortStepError(
        f"{num_rows} rows{f' of {row_tokens} tokens' if row_tokens else ''} cannot be split equally over dp = "
        f"{t.dp} replicas: {full} full steps of dp*micro_batches = {t.dp}*{t.micro_batches} micro-batches of "
        f"{per_mb} row(s) (max_tokens*cp = {t.micro_batch_tokens} tokens) leave {rest} rows for a last step, which "
        f"needs at least one row per micro-batch on every replica and the same micro-batch count on each "
        f"({missing} rows more would split); choose Topology.dp and Topology.micro_batches so that the rows fill "
        f"the steps ({num_rows} a multiple of dp*micro_batches, or its rest a multiple of dp), or raise "
        f"Topology.max_tokens{wider} (a micro-batch then holds {per_mb + 1} rows)",
        missing,
    )


def pack_equal_rows(rows: np.ndarray, topology: Topology, last_micro_batches: int | None = None) -> list:
    """Packed steps (one piece per step: units sorted by micro-batch, [1, micro-batches] sizes) for equal units,
    `rows[s]` of them in step s in shuffled order: the j-th unit of a step goes to replica `j % dp`, micro-batch
    `(j // dp) % M`, so replicas and micro-batches differ by at most one unit. The last step runs
    `last_micro_batches` (M', default M) micro-batches per replica."""
    dp, m = topology.dp, topology.micro_batches
    packed, first = [], 0
    for s, count in enumerate(rows.tolist()):
        ms = m if last_micro_batches is None or s < len(rows) - 1 else last_micro_batches
        j = np.arange(count)
        bins = (j % dp) * ms + (j // dp) % ms
        order = np.argsort(bins, kind="stable")
        packed.append((first + order, np.bincount(bins, minlength=dp * ms)[None, :]))
        first += count
    return packed


def borrow_for_small_steps(groups: list[np.ndarray], u_cost: np.ndarray, nb: int, merge: bool = True) -> None:
    """Make every step (an array of unit indices) hold at least `nb` units, in place.

    A too-small last step borrows the cheapest units of the step before when that one can spare them. Any other
    too-small step (e.g. a group of heavy documents whose light share is smaller than one light document) borrows
    the cheapest units of a neighbour that can spare them (merging would give the step a second heavy group), and
    is merged into its neighbour only when neither can. `merge=False` (a fixed step count, with at least `nb` units
    per step in all): never merged, the units come from the steps that can spare the most.
    """
    if len(groups) > 1 and len(groups[-1]) < nb and len(groups[-2]) - (nb - len(groups[-1])) >= nb:
        _lend(groups, len(groups) - 2, len(groups) - 1, nb - len(groups[-1]), u_cost)
    s = 0
    while s < len(groups) and len(groups) > 1:
        if len(groups[s]) >= nb:
            s += 1
            continue
        need = nb - len(groups[s])
        lender = next((o for o in (s + 1, s - 1) if 0 <= o < len(groups) and len(groups[o]) - need >= nb), None)
        if lender is not None:
            _lend(groups, lender, s, need, u_cost)
            s += 1
            continue
        if not merge:
            while len(groups[s]) < nb:
                spare = np.array([len(g) for g in groups]) - nb
                spare[s] = 0
                lender = int(np.argmax(spare))
                if spare[lender] <= 0:
                    raise ValueError(f"{sum(len(g) for g in groups)} units cannot fill {len(groups)} steps of {nb}")
                _lend(groups, lender, s, min(nb - len(groups[s]), int(spare[lender])), u_cost)
            s += 1
            continue
        other = s + 1 if s + 1 < len(groups) else s - 1
        groups[min(s, other)] = np.sort(np.concatenate([groups[s], groups[other]]))
        del groups[max(s, other)]
        s = min(s, other)


def _lend(groups: list[np.ndarray], lender: int, borrower: int, count: int, u_cost: np.ndarray) -> None:
    """Move the `count` cheapest units of step `lender` to step `borrower` (kept sorted)."""
    take = np.argsort(u_cost[groups[lender]], kind="stable")[:count]
    keep = np.ones(len(groups[lender]), dtype=bool)
    keep[take] = False
    groups[borrower] = np.sort(np.concatenate([groups[borrower], groups[lender][take]]))
    groups[lender] = groups[lender][keep]
