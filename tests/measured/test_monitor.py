"""BalanceMonitor in one process (dp = 1): adapt plans the windows from two after a refit with the fitted model and
nothing else changes (every document once, same step counts), shadow never changes a plan, resume with a monitor
attached is exact (the remainder and the monitor's models equal the uninterrupted run's), warm-up and outliers are
left out and reported, bad calls raise, the report plots."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from support.coverage import covered_tokens

import balancer
from balancer.measured import BalanceMonitor, plot_report
from balancer.training.indices import Span

TRUE = balancer.CostModel(attn_coef=2e-7, linear_coef=3e-5, fixed=1e-3)
FLOPS = balancer.CostModel(attn_coef=1.0, linear_coef=10.0)
TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=1024, tokens_per_step=1600)
LENGTHS = np.random.default_rng(0).integers(20, 400, 800)
WINDOW = 160


def _sampler():
    return balancer.BalancedBatchSampler(LENGTHS, TOPO, FLOPS, dp_rank=0, seed=0, window_docs=WINDOW)


def fake_seconds(mb, lengths, slow=1.0):
    """Deterministic 'measured' time: the true model with 2% noise keyed by the micro-batch's documents."""
    sizes = np.array([(i.end - i.start) if isinstance(i, Span) else int(lengths[i]) for i in mb])
    u = zlib.crc32(repr(mb).encode()) / 2**32 - 0.5
    return TRUE.micro_batch_cost(sizes) * (1 + 0.04 * u) / slow


def _train(sampler, monitor, steps=None, spikes=()):
    """Run the loop; returns the micro-batches seen."""
    seen, m, step = [], TOPO.micro_batches, sampler.position // TOPO.micro_batches
    for i, mb in enumerate(sampler):
        seen.append(mb)
        k = i % m
        t = fake_seconds(mb, LENGTHS) * (5.0 if (step, k) in spikes else 1.0)
        monitor.record(t)
        if k == m - 1:
            monitor.end_step()
            step += 1
            if steps is not None and len(seen) == steps * m:
                break
    return seen


def test_adapt_plans_later_windows_with_the_fit_and_keeps_everything_else():
    s = _sampler()
    counts = [s.windows.steps(w) for w in range(s.num_windows)]
    mon = BalanceMonitor(s, mode="adapt")
    seen = _train(s, mon)
    assert s.num_windows == 5 and [s.windows.steps(w) for w in range(5)] == counts
    assert covered_tokens([i for mb in seen for i in mb], LENGTHS) == covered_tokens(range(len(LENGTHS)), LENGTHS)
    assert [r["first"] for r in mon.refits][:2] == [[0, 2], [0, 3]] and mon.refits[0]["accepted"]
    assert s.windows.model(0)[1] == FLOPS and s.windows.model(1)[1] == FLOPS
    fitted = s.windows.model(2)[1]
    assert fitted != FLOPS and fitted.attn_coef == pytest.approx(TRUE.attn_coef, rel=0.3)
    rep = mon.report()
    assert rep["steps"] == sum(counts) and rep["warmup_steps"] == 2
    assert rep["fresh_error_median"] < 0.03 and rep["fresh_error_p90"] < 0.05
    assert rep["models"][1]["prediction_error_median"] < 0.03
    assert rep["measured_imbalance"] == 1.0 and rep["idle_fraction"] == 0.0  # one replica
    assert rep["cost"] == mon.models[-1].cost.to_dict() and rep["monitor_cpu_seconds"] > 0
    json.dumps(rep)


def test_shadow_never_changes_a_plan():
    plain = list(_sampler())
    s = _sampler()
    mon = BalanceMonitor(s, mode="shadow")
    assert _train(s, mon) == plain
    assert any(r["accepted"] for r in mon.refits)  # fitted and reported ...
    assert all(s.windows.model(w)[1] == FLOPS for w in range(5))  # ... never planned with
    assert mon.report()["cost"]["attn_coef"] == pytest.approx(TRUE.attn_coef, rel=0.3)


@pytest.mark.slow  # ~3 s per case
@pytest.mark.parametrize("cut_steps", [30, 44, 50])  # inside window 1, at the boundary of window 2, inside it
def test_resume_with_a_monitor_is_exact(cut_steps):
    s = _sampler()
    mon = BalanceMonitor(s, mode="adapt")
    full = _train(s, mon)
    a = _sampler()
    ma = BalanceMonitor(a, mode="adapt")
    head = _train(a, ma, steps=cut_steps)
    state = json.loads(json.dumps(a.state_dict()))
    assert "monitor" in state
    b = _sampler()
    mb = BalanceMonitor(b, mode="adapt", warmup_steps=0)  # the same evidence as the uninterrupted run
    b.load_state_dict(state)
    assert mb.models == ma.models
    tail = _train(b, mb)
    assert head + tail == full
    assert [m.cost for m in mb.models] == [m.cost for m in mon.models]


def test_warmup_and_outliers_are_left_out_and_reported():
    s = _sampler()
    mon = BalanceMonitor(s, mode="adapt", warmup_steps=3)
    _train(s, mon, spikes={(10, 0), (25, 1), (60, 0)})
    rep = mon.report()
    assert rep["warmup_steps"] == 3
    listed = {(o["step"], o["micro_batch"]) for o in rep["outliers"]["micro_batches"]}
    assert {(10, 0), (25, 1), (60, 0)} <= listed and rep["outliers"]["count"] <= 6
    assert "MAD" in rep["outliers"]["rule"] and "warm-up" in rep["outliers"]["rule"]
    assert rep["models"][1]["prediction_error_p90"] < 0.05  # the spikes did not spoil the fit


def test_bad_calls_raise():
    s = _sampler()
    with pytest.raises(ValueError, match="mode must be one of"):
        BalanceMonitor(s, mode="on")
    mon = BalanceMonitor(s)
    with pytest.raises(ValueError, match="already has a BalanceMonitor"):
        BalanceMonitor(s)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="seconds must be a finite number"):
            mon.record(bad)
    mon.record(0.1)
    with pytest.raises(ValueError, match="recorded twice"):
        mon.record(0.1, micro_batch=0)
    with pytest.raises(ValueError, match="has 1 recorded micro-batches of 2"):
        mon.end_step()
    with pytest.raises(ValueError, match="not a BalanceMonitor state"):
        mon.load_state_dict({"format": "x"})


def test_plot_report(tmp_path):
    pytest.importorskip("matplotlib")
    s = _sampler()
    mon = BalanceMonitor(s, mode="adapt")
    _train(s, mon, steps=40)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(mon.report()))
    out = plot_report(path, tmp_path / "balance.png")
    assert (tmp_path / "balance.png").stat().st_size > 10_000 and out.endswith("balance.png")
    with pytest.raises(ValueError, match="no measured steps"):
        plot_report({"series": {"measured": []}}, tmp_path / "x.png")


def test_refit_cpu_is_counted_apart_from_the_monitors_own(monkeypatch):
    """monitor_cpu_seconds is record + end_step without the refits (refit_cpu_seconds): a slow refit inside
    end_step must not show as per-step monitor overhead."""
    import time

    import balancer.measured.monitor as monitor_module

    real = monitor_module.refit

    def slow_refit(*args, **kwargs):
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(monitor_module, "refit", slow_refit)
    s = _sampler()
    mon = BalanceMonitor(s, mode="adapt")
    _train(s, mon)
    rep = mon.report()
    refits = len(mon.refits)
    assert refits >= 4 and rep["refit_cpu_seconds"] >= 0.3 * refits
    assert rep["monitor_cpu_seconds"] < 0.3


def test_report_says_when_fitted_speeds_want_more_tokens_than_a_replica_holds():
    """report["token_bound"]: the fitted speeds' ask of the fastest replica against what it holds, and the step
    budget that leaves it room (None when it has room)."""
    from types import SimpleNamespace

    from balancer.measured.ledger import Model
    from balancer.measured.report import _token_bound

    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=1024, tokens_per_step=6963)
    monitor = SimpleNamespace(topology=topo)
    fast = Model(TRUE, (2.0, 2 / 3, 2 / 3, 2 / 3), True)
    assert _token_bound(monitor, fast) == {"tokens_asked": 3481, "tokens_held": 2048, "tokens_per_step_with_room": 3686}
    assert _token_bound(monitor, Model(TRUE, (1.05, 0.95, 1.0, 1.0), True)) is None  # 1828 of 2048: room
    assert _token_bound(monitor, None) is None and _token_bound(monitor, Model(TRUE, None, True)) is None


def test_fitted_speeds_close_to_each_other_are_planned_as_even():
    """Fitted speeds whose fastest / slowest is below EVEN_SPEEDS reach the plans as even ranks (no speeds: the
    even planner), while the model keeps them for its predictions; a real difference is planned."""
    from balancer.measured.monitor import EVEN_SPEEDS, _pack_fit

    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=1024, tokens_per_step=1600)
    sampler = balancer.BalancedBatchSampler(LENGTHS, topo, FLOPS, dp_rank=0, seed=0, window_docs=WINDOW)
    mon = BalanceMonitor(sampler, mode="adapt")
    close = (1.0 + (EVEN_SPEEDS - 1) / 2.2, 1.0 - (EVEN_SPEEDS - 1) / 2.2)
    mon._apply(_pack_fit(TRUE, close, (0, 2), 2))
    assert mon.models[-1].speeds == pytest.approx(close) and mon.models[-1].plan_speeds is None
    assert mon.model_for(0, 2)[0].rank_speeds is None
    mon._apply(_pack_fit(TRUE, (1.3, 0.7), (0, 3), 2))
    assert mon.models[-1].plan_speeds == pytest.approx((1.3, 0.7))
    assert mon.model_for(0, 3)[0].rank_speeds == pytest.approx((1.3, 0.7))


def test_fitted_speeds_within_the_evidence_noise_are_planned_as_even():
    """A fit whose speeds the evidence does not tell apart from noise (flag 3, refit.speed_noise) is planned as even
    ranks however far apart the fitted speeds are; the model keeps them for its predictions."""
    from balancer.measured.monitor import _pack_fit

    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=1024, tokens_per_step=1600)
    sampler = balancer.BalancedBatchSampler(LENGTHS, topo, FLOPS, dp_rank=0, seed=0, window_docs=WINDOW)
    mon = BalanceMonitor(sampler, mode="adapt")
    mon._apply(_pack_fit(TRUE, (1.3, 0.7), (0, 2), 2, supported=False))
    assert mon.models[-1].speeds == pytest.approx((1.3, 0.7)) and mon.models[-1].plan_speeds is None
    assert mon.model_for(0, 2)[0].rank_speeds is None
    mon._apply(_pack_fit(TRUE, (1.3, 0.7), (0, 3), 2, supported=True))
    assert mon.model_for(0, 3)[0].rank_speeds == pytest.approx((1.3, 0.7))
