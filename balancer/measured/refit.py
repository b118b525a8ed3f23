"""The refit of adapt mode: a cost model in seconds and the relative speed of every DP replica from measured
micro-batches, outliers left out, and a candidate refused when it predicts held-back micro-batches worse than the
model in force.

A sample is one micro-batch of one replica: its pieces' token counts (in packing order), the CP size it ran on and
the measured seconds (the slowest of the replica's ranks). The model: `seconds = micro_batch_time(cost, sizes, cp) /
speed[replica]` (balancer.planning.cost.predict: the slowest CP rank under the layout). The fit alternates two
exact steps: with the speeds fixed, `CostModel.fit` on the speed-corrected seconds (non-negative least squares on
relative errors); with the cost fixed, each replica's speed is the median over its steps of predicted / measured
step totals (its samples of one step summed: the planner balances a replica's step, so a long micro-batch weighs by
its time; over single micro-batches a replica that is faster on short work than on long would read too fast).
Speeds are normalised to a mean of 1, so the cost model is in seconds of an average replica; after the rounds
every time coefficient is scaled by the median measured / predicted ratio (least squares on relative errors
predicts low under noise; one common factor changes none of the fit's plans).

Dynamic CP: the "replicas" are the pool ranks and a sample is one pool rank's view of its group's micro-batch
(every member has one: `group` is the group's (start, size)); a group runs at its slowest member's speed, so a
sample is predicted with that speed and counts towards a rank's speed only while that rank is its group's slowest
(by the previous round's speeds; in the first round every member counts).

Outliers (a GC pause, a checkpoint write inside a timed region, a noisy neighbour): a sample whose log residual
`log(measured * speed / predicted)` is further than `max(OUTLIER_MADS * 1.4826 * MAD, log(OUTLIER_MIN_RATIO))` from
its replica's median is left out and the fit repeated once without it (`OUTLIER_RULE` says it in words).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from balancer.planning.cost.fit import TERMS, fit_cost_model
from balancer.planning.cost.microbatch import micro_batch_terms, rank_times
from balancer.planning.cost.model import CostModel
from balancer.planning.cost.predict import micro_batch_times
from balancer.planning.speeds import group_speeds

ROUNDS = 4  # alternations of speeds and cost; the speeds move by well under 1% after the third on every test case
OUTLIER_MADS = 5.0
OUTLIER_MIN_RATIO = 1.3
OUTLIER_OWN_MEDIAN = 5  # a replica with this many samples is judged from its own median ratio
OUTLIER_RULE = (
    f"warm-up: the first steps after the monitor starts or resumes; then a micro-batch whose measured / predicted "
    f"time (its replica's speed included) is more than max({OUTLIER_MADS:g} robust standard deviations (1.4826 * "
    f"MAD of the log ratios), a factor {OUTLIER_MIN_RATIO:g}) away from its replica's median ratio (the median of "
    f"all when the replica has fewer than {OUTLIER_OWN_MEDIAN} micro-batches)"
)
HOLD_EVERY = 4  # every 4th step of the evidence is held back to judge a candidate against the model in force
SPEED_SIGMAS = 3.0  # fitted speeds are planned only when fastest / slowest is this many standard errors above 1


@dataclass
class Samples:
    """Measured micro-batches: `sizes[i]` piece token counts, `cp[i]`, `replica[i]`, `seconds[i]` (> 0), `step[i]`
    (the step's position in the run, for the held-back split)."""

    sizes: list
    cp: np.ndarray
    replica: np.ndarray
    seconds: np.ndarray
    step: np.ndarray
    terms: list | None = None  # per sample MicroBatchTerms for one (causal, window, layout), computed once
    group: np.ndarray | None = None  # [n, 2] (start, size) of each sample's CP group of pool ranks; None: alone

    def __len__(self) -> int:
        return len(self.seconds)

    def take(self, mask: np.ndarray) -> Samples:
        idx = np.flatnonzero(mask)
        terms = None if self.terms is None else [self.terms[i] for i in idx]
        pick = [self.sizes[i] for i in idx]
        group = None if self.group is None else self.group[idx]
        return Samples(pick, self.cp[idx], self.replica[idx], self.seconds[idx], self.step[idx], terms, group)

    def with_terms(self, like: CostModel, layout: str) -> Samples:
        """These samples with their layout terms computed (the refit's rounds reuse them)."""
        terms = [micro_batch_terms(np.asarray(d), int(c), layout, like.causal, like.window)
                 for d, c in zip(self.sizes, self.cp)]  # fmt: skip
        return Samples(self.sizes, self.cp, self.replica, self.seconds, self.step, terms, self.group)

    def speeds(self, speeds: np.ndarray) -> np.ndarray:
        """Each sample's speed: its replica's, or its group's slowest member's."""
        return sample_speeds(speeds, self.replica, self.group)

    def slowest(self, speeds: np.ndarray) -> np.ndarray:
        """True for the samples whose replica is (one of) its group's slowest under `speeds`."""
        return speeds[self.replica] <= self.speeds(speeds)


@dataclass
class Refit:
    """Outcome of one refit: `cost` and `speeds` (the candidate, also when refused), `accepted`, `reason`, the
    held-back errors (`score_current`, `score_candidate`: median + p90 of |measured - predicted| / measured) and the
    outliers' sample indices."""

    cost: CostModel | None
    speeds: tuple[float, ...] | None
    accepted: bool
    reason: str
    score_current: float = math.nan
    score_candidate: float = math.nan
    outliers: list = field(default_factory=list)
    samples: int = 0
    speed_noise: float = math.nan  # the log(fastest / slowest) that the evidence's noise alone reaches (speed_noise)
    speeds_supported: bool = False  # log(fastest / slowest) of the fitted speeds is above speed_noise


def sample_speeds(speeds: np.ndarray, replica: np.ndarray, group: np.ndarray | None) -> np.ndarray:
    """The speed each sample ran at: `speeds[replica]`, or with `group` [n, 2] the slowest of its group's members."""
    speeds = np.asarray(speeds, dtype=np.float64)
    return speeds[replica] if group is None else group_speeds(speeds, group[:, 0], group[:, 1])


def predict(
    cost: CostModel, sizes: list | None, cp: np.ndarray | None, layout: str = "zigzag", terms: Optional[list] = None
) -> np.ndarray:
    """Predicted seconds (cost units) of each sample on a speed-1 replica: the slowest CP rank of its layout
    (`terms`: the samples' precomputed terms, for the same mask and layout)."""
    if terms is not None:
        return np.array([float(rank_times(cost, t).max()) for t in terms])
    if sizes is None or cp is None:
        raise ValueError("predict needs the samples' sizes and cp, or their terms")
    out = np.empty(len(sizes))
    cp = np.asarray(cp, dtype=np.int64)
    batched = np.zeros(len(sizes), dtype=bool)
    # zigzag: every CP size at once through the vectorised form (the same numbers, bit for bit)
    if layout == "zigzag" and all(len(d) for d in sizes):
        for c in sorted({int(c) for c in cp if c > 1}):
            idx = np.flatnonzero(cp == c)
            docs = [np.asarray(sizes[i], dtype=np.int64) for i in idx]
            ptr = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
            out[idx] = micro_batch_times(cost, np.concatenate(docs), ptr, int(c))
            batched[idx] = True
    for i in np.flatnonzero(~batched):
        d, c = np.asarray(sizes[i], dtype=np.int64), int(cp[i])
        if c == 1:  # one rank: no layout, the plain per-document cost (pieces = documents)
            out[i] = cost.micro_batch_cost(d)
        else:
            out[i] = float(rank_times(cost, micro_batch_terms(d, c, layout, cost.causal, cost.window)).max())
    return out


def relative_errors(measured: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    return np.abs(measured - predicted) / measured


def score(measured: np.ndarray, predicted: np.ndarray) -> float:
    """median + p90 of the relative errors (the two figures the report gives)."""
    e = relative_errors(measured, predicted)
    return float(np.median(e) + np.quantile(e, 0.9)) if len(e) else math.nan


def fit_speeds(
    predicted: np.ndarray, seconds: np.ndarray, replica: np.ndarray, dp: int, step: np.ndarray | None = None
) -> np.ndarray:
    """Each replica's speed: exp(median log(predicted / measured)) over its steps (`step` given: a step's samples
    summed first, the quantity the planner balances, so a step's long micro-batches weigh by their time) or over
    its samples, normalised to a mean of 1 over the replicas that have samples (a replica without samples gets 1)."""
    speeds = np.ones(dp)
    seen = np.zeros(dp, dtype=bool)
    for r in range(dp):
        mine = replica == r
        if not mine.any():
            continue
        pred, sec = predicted[mine], seconds[mine]
        if step is not None:
            ids, at = np.unique(step[mine], return_inverse=True)
            pred, sec = np.bincount(at, pred, len(ids)), np.bincount(at, sec, len(ids))
        speeds[r], seen[r] = math.exp(float(np.median(np.log(pred / sec)))), True
    speeds[seen] /= speeds[seen].mean()
    return speeds


def speed_noise(seconds: np.ndarray, predicted: np.ndarray, replica: np.ndarray, step: np.ndarray) -> float:
    """The log(fastest / slowest) speed ratio that noise alone reaches: SPEED_SIGMAS standard errors of the
    difference of two replicas' median log residuals (`predicted` includes the speeds). A replica's standard error
    is 1.2533 (the median's) x 1.4826 x the MAD of its log residuals / sqrt(its steps): steps, not micro-batches,
    because the micro-batches of one step share that step's machine-wide speed swing. The two noisiest replicas
    are taken (the bound then holds for every pair)."""
    res = np.log(seconds / predicted)
    se = []
    for r in np.unique(replica):
        mine = res[replica == r]
        mad = float(np.median(np.abs(mine - np.median(mine))))
        se.append(1.2533 * 1.4826 * mad / math.sqrt(len(np.unique(step[replica == r]))))
    if len(se) < 2:
        return math.inf
    a, b = sorted(se)[-2:]
    return SPEED_SIGMAS * math.hypot(a, b)


def outlier_mask(seconds: np.ndarray, predicted: np.ndarray, unit: np.ndarray | None = None) -> np.ndarray:
    """True for samples outside the robust band of OUTLIER_RULE (`predicted` includes the replica speeds). With
    `unit` (each sample's replica, or pool rank) a sample is measured from its own unit's median ratio when that
    unit has OUTLIER_OWN_MEDIAN samples or more: a replica whose speed the model does not know (the sampler's
    model, a wrong fitted speed) is a prediction error, not a replica of outliers."""
    res = np.log(seconds / predicted)
    mid = np.full(len(res), float(np.median(res)) if len(res) else 0.0)
    if unit is not None:
        for u in np.unique(unit):
            mine = unit == u
            if mine.sum() >= OUTLIER_OWN_MEDIAN:
                mid[mine] = np.median(res[mine])
    mad = float(np.median(np.abs(res - mid))) if len(res) else 0.0
    band = max(OUTLIER_MADS * 1.4826 * mad, math.log(OUTLIER_MIN_RATIO))
    return np.abs(res - mid) > band


def fit(
    samples: Samples,
    like: CostModel,
    dp: int,
    *,
    layout: str = "zigzag",
    speeds: bool = True,
    median_scale: bool = True,
) -> tuple:
    """(cost, speeds, outlier mask) fitted to `samples` (module docstring). `like` gives the mask (causal, window)
    and the fields that are not fitted; `speeds=False` keeps every replica at 1; `median_scale=False` leaves the
    least-squares scale (benchmarks/refit_scale.py compares the two)."""
    if samples.terms is None:
        samples = samples.with_terms(like, layout)
    keep = np.ones(len(samples), dtype=bool)
    s = np.ones(dp)
    cost = like
    for outlier_pass in range(2):
        sub = samples.take(keep)
        for _ in range(ROUNDS if speeds else 1):
            cost = _fit_cost(sub, sub.seconds * sub.speeds(s), like, layout)
            if speeds:
                s = _round_speeds(cost, sub, s, dp)
        if median_scale:
            cost = _median_scaled(cost, sub, s)
        if outlier_pass == 0:
            pred = predict(cost, None, None, terms=samples.terms) / samples.speeds(s)
            out = outlier_mask(samples.seconds, pred, samples.replica)
            if not out.any() or (~out).sum() < len(samples) // 2:
                break
            keep = ~out
    return cost, s, ~keep


def _median_scaled(cost: CostModel, sub: Samples, s: np.ndarray) -> CostModel:
    """`cost` with every time coefficient times the median measured / predicted ratio of `sub` (speeds `s`).
    Least squares on relative errors predicts low under noise (for a constant model it scales by E[1/e] / E[1/e^2]
    of the noise factor e, exp(-1.5 sigma^2) when lognormal): at CP 2 on the benchmark the first fit predicted its
    own evidence 3-19% low. The fit's shape, and so every plan made with it, is unchanged (every time term is
    linear in the coefficients, and max(k a, k b) = k max(a, b)); the median error is the report's. Which fit the
    held-back judgment accepts can change: its score depends on the scale."""
    ratio = sub.seconds * sub.speeds(s) / predict(cost, None, None, terms=sub.terms)
    k = float(np.median(ratio))
    return dataclasses.replace(cost, **{name: getattr(cost, name) * k for name in TERMS})  # the time terms


def _round_speeds(cost: CostModel, sub: Samples, s: np.ndarray, dp: int) -> np.ndarray:
    """One round's replica speeds under `cost` (`fit_speeds`). Dynamic CP: from the samples where the rank was its
    group's slowest under the previous round's speeds `s`; a rank that never was keeps its speed there."""
    pred = predict(cost, None, None, terms=sub.terms)
    if sub.group is None:
        return fit_speeds(pred, sub.seconds, sub.replica, dp, sub.step)
    own = sub.slowest(s)
    new = fit_speeds(pred[own], sub.seconds[own], sub.replica[own], dp, sub.step[own])
    unseen = ~np.isin(np.arange(dp), sub.replica[own])
    new[unseen] = s[unseen]
    return new / new.mean()


def _fit_cost(sub: Samples, seconds: np.ndarray, like: CostModel, layout: str) -> CostModel:
    """`CostModel.fit` (balancer.planning.cost.fit, on the terms computed once for the refit's rounds) of attention
    pairs, tokens, fixed and pieces, with CP also the communication terms, on relative errors. Without CP there is
    no communication to fit: the communication terms are 0 and `like`'s `comm_overlap` is kept."""
    cp = bool(np.any(sub.cp > 1))
    cost = fit_cost_model(
        CostModel, sub.sizes, seconds, causal=like.causal, window=like.window, fit_fixed=True, fit_pieces=True,
        fit_comm=cp, cp=sub.cp, layout=layout, method="ring", layout_options={}, terms=sub.terms,
    )  # fmt: skip
    overlap = cost.comm_overlap if cp else like.comm_overlap
    return dataclasses.replace(cost, kv_bytes_per_token=like.kv_bytes_per_token, comm_overlap=overlap)


def refit(
    samples: Samples,
    current: CostModel,
    current_speeds: Optional[Sequence[float] | np.ndarray],
    dp: int,
    *,
    current_in_seconds: bool,
    layout: str = "zigzag",
    min_samples: int = 32,
    speeds: bool = True,
) -> Refit:
    """One refit: fit on the samples of steps not held back (every HOLD_EVERY-th step is), score the candidate
    and the model in force (scaled by one factor when it is not in seconds yet) on the held-back ones, accept the
    candidate only when it scores better. Refused (with the reason) below `min_samples` or without samples of every
    replica."""
    n = len(samples)
    if n < min_samples:
        return Refit(None, None, False, f"{n} measured micro-batches, the first refit needs {min_samples}", samples=n)
    if speeds and len(np.unique(samples.replica)) < dp:
        return Refit(None, None, False, "not every replica has measured micro-batches yet", samples=n)
    held = (samples.step % HOLD_EVERY) == HOLD_EVERY - 1
    if held.sum() < 4 or (~held).sum() < min_samples // 2:
        held = np.arange(n) % HOLD_EVERY == HOLD_EVERY - 1
    samples = samples.with_terms(current, layout)
    train, test = samples.take(~held), samples.take(held)
    try:
        cost, s, out = fit(train, current, dp, layout=layout, speeds=speeds)
    except ValueError as e:
        return Refit(None, None, False, f"the fit failed: {e}", samples=n)
    cand = predict(cost, None, None, terms=test.terms) / test.speeds(s)
    cur_s = np.ones(dp) if current_speeds is None else np.asarray(current_speeds, dtype=np.float64)
    cur = predict(current, None, None, terms=test.terms) / test.speeds(cur_s)
    inliers = ~outlier_mask(test.seconds, cand, test.replica)
    if not current_in_seconds:  # a model in FLOPs (or any unit): judged by its shape, at its best single scale
        cur = cur * float(np.median(test.seconds[inliers] / cur[inliers]))
    sc_cand = score(test.seconds[inliers], cand[inliers])
    sc_cur = score(test.seconds[inliers], cur[inliers])
    outliers = [int(i) for i in np.flatnonzero(~held)[out]] + [int(i) for i in np.flatnonzero(held)[~inliers]]
    fitted = tuple(float(x) for x in s) if speeds else None
    noise, supported = math.nan, False
    if speeds:
        kept = train.take(~out)
        kept = kept.take(kept.slowest(s))
        noise = speed_noise(kept.seconds, predict(cost, None, None, terms=kept.terms) / kept.speeds(s),
                            kept.replica, kept.step)  # fmt: skip
        supported = bool(math.log(float(s.max()) / float(s.min())) > noise)
    extra = (noise, supported)
    if not sc_cand < sc_cur:
        reason = f"refused: held-back error {sc_cand:.3f} (median + p90) is not below the current model's {sc_cur:.3f}"
        return Refit(cost, fitted, False, reason, sc_cur, sc_cand, sorted(outliers), n, *extra)
    reason = f"accepted: held-back error {sc_cand:.3f} (median + p90) against {sc_cur:.3f} for the current model"
    if speeds and not supported:
        reason += f"; speeds {max(s) / min(s):.3f}x apart, within the noise ({math.exp(noise):.3f}x): planned as even"
    return Refit(cost, fitted, True, reason, sc_cur, sc_cand, sorted(outliers), n, *extra)
