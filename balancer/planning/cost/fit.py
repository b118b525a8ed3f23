"""Fitting a CostModel to measured micro-batch times (`CostModel.fit`).

Every sample is a micro-batch (document lengths in packing order) timed on `cp` ranks with a CP layout and method.
The predicted time (cost/microbatch.py) is linear in the coefficients once two choices are fixed: which CP
rank is the slowest, and, in every ring step, whether compute or transfer is the larger side of
`max(compute, transfer)`. The fit alternates: fix the choices under the current coefficients, solve a non-negative
least-squares problem on relative errors (every row divided by its measured time, so a 10 ms and a 10 s sample
count alike), repeat until the choices stop changing. With `fit_comm` it fits both kinds of ring step, transfers
added to compute (`comm_overlap=False`, one linear solve) and transfers overlapped with it (started from transfer
costing 1/4, 1 and 4 times the compute it overlaps), and keeps the best fit.

`loss` "squares" (the default, what the monitor's refit uses) is that plain least squares. On timings from a shared
machine a few disturbed samples can pull it: "huber" refits with Huber weights on the relative errors (full weight
within `HUBER_K` robust scales of the median error, weight falling as 1/|error| beyond), "trim" refits without the
samples further than `TRIM_K` robust scales from it (outlier rejection); the robust scale is 1.4826 x the median
absolute deviation of the relative errors, at least `MIN_SCALE`. Both repeat until the weights settle
(`ROBUST_ROUNDS` at most).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from balancer.planning.cost.microbatch import METHODS, fit_features_batch, micro_batch_terms, stack_terms

if TYPE_CHECKING:
    from balancer.planning.cost.model import CostModel

# The cost model's time terms, in the order of the fit's features (`fit_features_batch`): the one list of their
# names (CostModel's coefficients are these and `kv_bytes_per_token`; the monitor's fits travel in this order).
TERMS = ("attn_coef", "linear_coef", "fixed", "piece_coef", "comm_coef", "comm_latency")
COMM_STARTS = (0.25, 1.0, 4.0)
MAX_ROUNDS = 20
LOSSES = ("squares", "huber", "trim")
HUBER_K, TRIM_K, MIN_SCALE, ROBUST_ROUNDS = 1.345, 3.0, 0.005, 10


def _per_sample(value, n: int, name: str) -> list:
    if isinstance(value, (str, int, np.integer)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"CostModel.fit: {name} has {len(value)} entries for {n} samples")
    return value


def _solve(features: np.ndarray, seconds: np.ndarray, active: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """NNLS of `sum weights * (predicted / seconds - 1) ** 2` over the active terms."""
    from scipy.optimize import nnls

    root = np.sqrt(weights)
    a = features[:, active] / seconds[:, None] * root[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, root)
    out = np.zeros(len(TERMS))
    out[active] = coef / scale
    return out


def _model(cls, coef: np.ndarray, causal: bool, window, overlap: bool = True):
    values = dict(zip(TERMS, (float(c) for c in coef)))
    if values["attn_coef"] == 0 and values["linear_coef"] == 0:
        raise ValueError("CostModel.fit: the timings fit no positive attention or linear coefficient")
    return cls(**values, causal=causal, window=window, comm_overlap=overlap)


def fit_cost_model(
    cls: type[CostModel],
    lengths: Sequence,
    seconds: ArrayLike,
    *,
    causal: bool,
    window: int | None,
    fit_fixed: bool,
    fit_pieces: bool,
    fit_comm: bool,
    cp: int | Sequence[int] | np.ndarray,
    layout: str | Sequence[str],
    method: str | Sequence[str],
    layout_options: dict,
    terms: list | None = None,
    loss: str = "squares",
) -> CostModel:
    """See `CostModel.fit`. `terms`: the samples' `micro_batch_terms` when the caller has them already (the online
    refit fits the same samples several times). `loss`: "squares", "huber" or "trim" (module docstring)."""
    if loss not in LOSSES:
        raise ValueError(f"CostModel.fit: loss must be one of {LOSSES}, got {loss!r}")
    seconds = np.asarray(seconds, dtype=np.float64)
    if seconds.ndim != 1 or len(seconds) != len(lengths):
        raise ValueError(f"CostModel.fit: got {len(lengths)} samples of lengths but {seconds.shape} seconds")
    if not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise ValueError("CostModel.fit: seconds must be finite and > 0")
    n = len(seconds)
    cps, kinds, methods = _per_sample(cp, n, "cp"), _per_sample(layout, n, "layout"), _per_sample(method, n, "method")
    active = np.array([True, True, fit_fixed, fit_pieces, fit_comm, fit_comm])
    if fit_comm and not any(int(c) > 1 for c in cps):
        raise ValueError("CostModel.fit: fit_comm needs samples timed with cp > 1")
    if n < int(active.sum()) + 1:
        raise ValueError(
            f"CostModel.fit needs at least {int(active.sum()) + 1} timed samples to fit {int(active.sum())} terms "
            f"({', '.join(t for t, a in zip(TERMS, active) if a)}); got {n}"
        )
    given, terms = terms, []
    for i, item in enumerate(lengths):
        d = np.atleast_1d(np.asarray(item))
        if (d.size == 0 and given is None) or np.any(d < 1):  # an empty micro-batch's terms, given: its fixed cost
            raise ValueError(f"CostModel.fit: sample {i} has an empty or non-positive length")
        if methods[i] not in METHODS:
            raise ValueError(f"CostModel.fit: sample {i} has method {methods[i]!r}, not one of {METHODS}")
        if given is None:
            terms.append(micro_batch_terms(d, int(cps[i]), kinds[i], causal, window, **layout_options))
    terms = terms if given is None else list(given)

    batches = _batches(terms, methods)

    def features(model):  # [n, terms] of every sample, a batch of one (CP size, method) at a time
        out = np.empty((n, len(TERMS)))
        for idx, method, stacked in batches:
            out[idx] = fit_features_batch(stacked, method, model)
        return out

    weights = np.ones(n)
    starts = _starts(features, seconds, active, terms, fit_comm, weights)
    best = _best(cls, starts, features, seconds, active, causal, window, weights)
    for _ in range(ROBUST_ROUNDS if loss != "squares" else 0):
        new = robust_weights(_relative_errors(best, features, seconds), loss)
        if np.allclose(new, weights, rtol=0.0, atol=1e-4):
            break
        weights = (
            new  # every start again under the new weights (a disturbed sample can flip comm_overlap), and the last fit
        )
        starts = _starts(features, seconds, active, terms, fit_comm, weights) + [(_coef(best), best.comm_overlap)]
        best = _best(cls, starts, features, seconds, active, causal, window, weights)
    return best


def _starts(features, seconds, active, terms, fit_comm: bool, weights) -> list:
    """[(starting coefficients, comm_overlap)]: the linear solve, and with `fit_comm` overlapped transfers from
    several starting speeds."""
    coef = _solve(features(None), seconds, active, weights)
    starts = [(coef, not fit_comm)]
    if fit_comm:  # transfers that add to compute (above) or overlap it, from several starting speeds
        compute_per_token = _compute_per_moved_token(terms, coef)
        for ratio in COMM_STARTS:
            start = coef.copy()
            start[TERMS.index("comm_coef")] = ratio * compute_per_token
            starts.append((start, True))
    return starts


def _best(cls, starts, features, seconds, active, causal, window, weights):
    """The fit of least weighted squared relative error over `starts` (an error only when every start fails)."""
    best = None
    failure: ValueError | None = None
    for start, overlap in starts:
        try:
            candidate = _iterate(cls, start, features, seconds, active, causal, window, overlap, weights)
        except ValueError as e:  # this start ran into a degenerate solve; the others may not
            failure = e
            continue
        if best is None or candidate[1] < best[1]:
            best = candidate
    if best is None:
        assert failure is not None, "starts is never empty: each one failed"
        raise failure
    return best[0]


def _coef(model) -> np.ndarray:
    return np.array([getattr(model, t) for t in TERMS])


def _relative_errors(model, features, seconds: np.ndarray) -> np.ndarray:
    return features(model) @ _coef(model) / seconds - 1.0


def robust_weights(errors: ArrayLike, loss: str) -> np.ndarray:
    """Row weights of a robust refit from the current relative errors: "huber" 1 within `HUBER_K` robust scales of
    their median and `HUBER_K * scale / distance` beyond; "trim" 1 within `TRIM_K` scales and 0 beyond; "squares"
    all 1. The scale is 1.4826 x the median absolute deviation, at least `MIN_SCALE`."""
    errors = np.asarray(errors, dtype=np.float64)
    if loss == "squares":
        return np.ones(len(errors))
    distance = np.abs(errors - np.median(errors))
    scale = max(1.4826 * float(np.median(distance)), MIN_SCALE)
    if loss == "huber":
        return np.minimum(1.0, HUBER_K * scale / np.maximum(distance, 1e-300))
    return (distance <= TRIM_K * scale).astype(np.float64)


def _batches(terms: list, methods: list) -> list:
    """[(sample indices, method, stacked terms)] per (CP size, method): `fit_features_batch`'s inputs, built once."""
    keys = sorted({(t.cp, m) for t, m in zip(terms, methods)})
    out = []
    for cp, method in keys:
        idx = np.array([i for i, (t, m) in enumerate(zip(terms, methods)) if t.cp == cp and m == method])
        out.append((idx, method, stack_terms([terms[i] for i in idx])))
    return out


def _iterate(cls, coef, features, seconds, active, causal, window, overlap: bool, weights: np.ndarray):
    """Alternate choices and NNLS from `coef`; returns (model, weighted sum of squared relative errors)."""
    model = _model(cls, coef, causal, window, overlap)
    previous = None
    for _ in range(MAX_ROUNDS):
        feats = features(model)
        if previous is not None and np.array_equal(feats, previous):
            break
        previous = feats
        model = _model(cls, _solve(feats, seconds, active, weights), causal, window, overlap)
    return model, float(np.sum(weights * _relative_errors(model, features, seconds) ** 2))


def _compute_per_moved_token(terms, coef) -> float:
    """Attention compute per K/V token moved, averaged over the CP samples (a scale for the starting comm_coef)."""
    compute = sum(coef[0] * t.pairs.sum() + coef[3] * t.pieces.sum() for t in terms if t.cp > 1)
    moved = sum(t.travel.sum() * t.cp for t in terms if t.cp > 1)
    return float(compute / moved) if moved else 0.0
