"""Held-out data never reaches a calibration fit: the split is by micro-batch (every CP size and layout of a
held-out micro-batch stays out), each reported split is judged with a model fitted without it, fresh micro-batches
are never fitted, and the clock and target checks say what they measured. Timings here come from a known cost model
(the unit under test is the fit and the split, not the timer); tests/test_calibrate.py times a real model."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balancer import CostModel
from balancer.calibration import calibration_grid, choose_clock, fresh_budgets, fresh_micro_batches
from balancer.calibration.report import fit_samples, split_errors, target_misses
from balancer.calibration.run import _fit_and_report
from balancer.calibration.split import composition, leaked_compositions, split_by_micro_batch
from balancer.calibration.timing import settled
from balancer.planning.cost.predict import micro_batch_time

TRUE = CostModel(
    attn_coef=1.2e-8, linear_coef=1e-5, fixed=3e-3, piece_coef=8e-5, comm_coef=1.5e-6, comm_latency=1e-3,
    comm_overlap=False,
)  # fmt: skip
CONFIGS = [(1, "zigzag"), (2, "zigzag"), (2, "hybrid")]


@given(
    budgets=st.lists(st.integers(16, 3000), min_size=1, max_size=4),
    per_cell=st.integers(1, 4),
    held_out=st.floats(0.05, 0.95),
    seed=st.integers(0, 10_000),
)
def test_no_held_out_composition_is_in_the_fit_set(budgets, per_cell, held_out, seed):
    grid = calibration_grid(budgets, per_cell=per_cell, seed=seed)
    held = split_by_micro_batch(grid, held_out, seed)
    fitted = {composition(lengths) for (_, lengths), h in zip(grid, held) if not h}
    out = {composition(lengths) for (_, lengths), h in zip(grid, held) if h}
    assert not fitted & out
    if len({composition(lengths) for _, lengths in grid}) > 1:
        assert fitted and out  # both sides hold something
    assert np.array_equal(held, split_by_micro_batch(grid, held_out, seed))  # seeded


def _samples(grid, held, corrupt: float = 1.0) -> list[dict]:
    """Every grid micro-batch on every (cp, layout), timed by the TRUE model; held-out ones times `corrupt`."""
    out = []
    for cp, kind in CONFIGS:
        for i, (k, lengths) in enumerate(grid):
            seconds = micro_batch_time(TRUE, lengths, cp, kind) * (corrupt if held[i] else 1.0)
            out.append(
                dict(kind=k, lengths=lengths, cp=cp, layout=kind, options={}, micro_batch=i, held_out=bool(held[i]))
                | dict(fresh=False, seconds=seconds, wall=[seconds], cpu=[seconds])
            )
    return out


def test_held_out_timings_do_not_move_the_fit():
    """Held-out micro-batches timed 3x too slow: a fit that never sees them recovers the true model and is exactly
    -67% off on them; a fit on everything (the leak this guards against) is pulled towards them."""
    grid = calibration_grid([1024, 2048, 4096], per_cell=3, seed=0)
    held = split_by_micro_batch(grid, 0.25, 0)
    samples = _samples(grid, held, corrupt=3.0)
    assert not leaked_compositions(samples)
    result = _fit_and_report(samples, grid, 0.25, range(0, 1), None, "ring", {})
    for term in ("attn_coef", "linear_coef", "fixed"):
        assert getattr(result.cost, term) == pytest.approx(getattr(TRUE, term), rel=1e-3)
    assert result.report["held_out"]["median_abs_error"] == pytest.approx(2 / 3, rel=1e-3)
    assert result.report["train"]["max_abs_error"] < 1e-3
    leaky = fit_samples(samples, None, "ring", {})  # everything, held-out included
    assert abs(leaky.linear_coef / TRUE.linear_coef - 1) > 0.05


def test_every_split_is_judged_by_a_fit_without_it():
    """Each split's held-out micro-batches carry a different error; the split's own fit must not see them."""
    grid = calibration_grid([1024, 2048, 4096], per_cell=3, seed=1)
    samples = _samples(grid, np.zeros(len(grid), dtype=bool))
    for seed in range(4):
        held = split_by_micro_batch(grid, 0.25, seed)
        bent = [s | {"seconds": s["seconds"] * (2.0 if held[s["micro_batch"]] else 1.0)} for s in samples]
        result = split_errors(bent, grid, 0.25, [seed], None, "ring", {})
        assert result["per_split"][0]["median_abs_error"] == pytest.approx(0.5, rel=1e-3)
    clean = split_errors(samples, grid, 0.25, range(5), None, "ring", {})
    assert clean["count"] == 5 and clean["failed"] == 0 and clean["worst_p90_abs_error"] < 1e-3
    assert len({tuple(split_by_micro_batch(grid, 0.25, s)) for s in range(5)}) > 1  # the splits differ


def test_fresh_micro_batches_are_outside_the_grid():
    budgets = [2048, 4096, 8192]
    fresh_b = fresh_budgets(budgets)
    assert fresh_b and not set(fresh_b) & set(budgets) and max(fresh_b) > max(budgets)
    fresh = fresh_micro_batches(fresh_b, per_budget=4, seed=0)
    assert [sum(lengths) for _, lengths in fresh] == [b for b in fresh_b for _ in range(4)]
    grid = {composition(lengths) for _, lengths in calibration_grid(budgets, per_cell=4, seed=0)}
    assert not grid & {composition(lengths) for _, lengths in fresh}
    assert fresh_micro_batches(fresh_b, 4, 0) == fresh


def test_clock_choice_says_why():
    quiet = {"load_per_core": 0.1, "wall_over_cpu": 1.02}
    busy = {"load_per_core": 2.5, "wall_over_cpu": 1.8}
    assert choose_clock("auto", quiet)[0] == "wall"
    clock, reason = choose_clock("auto", busy)
    assert clock == "cpu" and "busy" in reason and "2.50" in reason
    clock, reason = choose_clock("wall", busy)
    assert clock == "wall" and "NOT quiet" in reason
    assert choose_clock("cpu", quiet)[0] == "cpu"
    with pytest.raises(ValueError, match="--clock"):
        choose_clock("tsc", quiet)


def test_target_misses_name_the_figure():
    """Held-out splits are held to median 5% / p90 10%, fresh micro-batches (timed after the fit) to 10% / 20%."""
    report = {
        "splits": {"count": 8, "failed": 1, "median_abs_error": 0.04, "worst_p90_abs_error": 0.12},
        "fresh": {"median_abs_error": 0.11, "p90_abs_error": 0.19},
    }
    misses = target_misses(report)
    assert len(misses) == 3
    assert any("worst split" in m and "12.0%" in m and "> 10%" in m for m in misses)
    assert any("fresh" in m and "11.0%" in m and "> 10%" in m for m in misses)
    assert not any("19.0%" in m for m in misses)  # within the fresh p90 target of 20%
    report["fresh"] = {"median_abs_error": 0.06, "p90_abs_error": 0.21}
    assert [m for m in target_misses(report) if "fresh" in m] == ["fresh micro-batches p90 |error| 21.0% > 20%"]
    assert not target_misses({"splits": {"count": 8, "failed": 0, "median_abs_error": 0.04}})


def test_a_micro_batch_is_settled_when_its_two_fastest_runs_agree():
    assert not settled([(1.0, 1.0)])
    assert settled([(9.0, 1.0), (5.0, 1.015)])  # CPU time agrees within 2%; wall is not asked
    assert not settled([(9.0, 1.0), (5.0, 1.015)], clocks=(0, 1))
    assert not settled([(1.0, 1.0), (1.0, 1.2), (1.0, 1.3)])
    assert settled([(1.0, 1.3), (1.0, 1.0), (1.0, 1.2), (1.0, 1.01)])
