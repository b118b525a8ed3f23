"""Hostile restarts of an adapting monitor: a second and a third run over the same sampler (what a second and third
`Trainer.train()` do: `restart()`, then the sampler read from the start of its epoch again), a run stopped mid-pass
and restarted, and an old state (saved before the replica count was recorded, with no step measured) resumed. Every
run must give every document once, count its steps from the start of the pass, and keep the refits consistent with
the plans the sampler yields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from support.coverage import covered_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "measured"))
from test_monitor import FLOPS, LENGTHS, TOPO, WINDOW, fake_seconds  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

import balancer  # noqa: E402
from balancer.measured import BalanceMonitor  # noqa: E402

ALL = covered_tokens(range(len(LENGTHS)), LENGTHS)


def _sampler():
    return balancer.BalancedBatchSampler(LENGTHS, TOPO, FLOPS, dp_rank=0, seed=0, window_docs=WINDOW)


def _run(sampler, monitor, stop=None) -> tuple[list, list]:
    """One pass from the sampler's start (or `stop` micro-batches of it): the micro-batches and the steps closed."""
    seen, m, closed = [], TOPO.micro_batches, []
    for i, mb in enumerate(sampler):
        seen.append(mb)
        monitor.record(fake_seconds(mb, LENGTHS))
        if i % m == m - 1:
            monitor.end_step()
            closed.append((monitor.ledger.steps[-1]["epoch"], monitor.ledger.steps[-1]["step"]))
        if stop is not None and len(seen) == stop:
            break
    return seen, closed


@pytest.mark.parametrize("stop_first", [None, 7])  # the first run reads the whole pass / stops at 7 micro-batches
def test_three_runs_in_adapt_mode_each_cover_the_pass(stop_first):
    s = _sampler()
    mon = BalanceMonitor(s, mode="adapt")
    seen, _ = _run(s, mon, stop_first)
    for run in (2, 3):
        mon.restart()
        seen, closed = _run(s, mon)
        assert covered_tokens([i for mb in seen for i in mb], LENGTHS) == ALL, f"run {run} lost or repeated tokens"
        assert [k for _, k in closed] == list(range(len(closed))), f"run {run}'s steps do not count from 0"
    assert any(r["accepted"] for r in mon.refits)
    report = mon.report()
    assert report["steps"] == len(mon.ledger.steps)


def test_an_old_state_without_replica_count_or_steps_resumes():
    s = _sampler()
    mon = BalanceMonitor(s, mode="adapt")
    state = json.loads(json.dumps(s.state_dict()))  # at the start: no step measured yet
    del state["monitor"]["units"]
    fresh = _sampler()
    mon2 = BalanceMonitor(fresh, mode="adapt")
    fresh.load_state_dict(state)
    seen, closed = _run(fresh, mon2)
    assert covered_tokens([i for mb in seen for i in mb], LENGTHS) == ALL
    assert [k for _, k in closed] == list(range(len(closed)))
    assert mon.units == mon2.units


def _stream_seconds(mb: list) -> float:
    n = np.array([len(r["input_ids"]) for r in mb], dtype=np.float64)
    return float(1e-3 + 2e-5 * n.sum() + 4e-8 * (n * n).sum())


@pytest.mark.parametrize("stops", [(9, None, None, 5, None), (None, None, None)])
def test_three_runs_in_adapt_mode_on_a_stream(stops):
    # a second and third train() on the stream path: restart(), then a new iter() of the same epoch. Old: the third
    # run's first accepted refit raised ValueError "first_window=2 is before an earlier update's (4)" from the
    # stream (the changes of the run before, for later windows of the same epoch, were taken as this pass's)
    from balancer.measured import StreamSteps
    from balancer.streaming import BalancedStream

    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=512)
    with BalancedStream(doc_rows(120, 0), topo, balancer.CostModel(1.0, 50.0), window_docs=24) as s:
        mon = BalanceMonitor(StreamSteps(s), mode="adapt", warmup_steps=0, min_samples=8, cuda=False)
        for run, stop in enumerate(stops):
            if run:
                mon.restart()
            docs, steps = [], []
            for i, mb in enumerate(s):
                docs += [r["doc"] for r in mb]
                mon.record(_stream_seconds(mb))
                if i % 2 == 1:
                    mon.end_step()
                    steps.append(mon.ledger.steps[-1]["step"])
                if stop is not None and i + 1 == stop:
                    break
            if stop is None:
                assert sorted(docs) == list(range(120)), f"run {run} lost or repeated documents"
            assert steps == list(range(len(steps))), f"run {run}'s steps do not count from 0"
            for w, (_, seg) in s.window_plans.items():  # the monitor and the stream agree on each window's model
                assert seg.cost == mon.model_for(s.epoch, w)[1]
        assert sum(r["accepted"] for r in mon.refits) >= 2


def _state_after(steps: int) -> dict:
    s = _sampler()
    mon = BalanceMonitor(s, mode="adapt")
    it = iter(s)
    for i in range(2 * steps):
        next(it)
        mon.record(0.01)
        if i % 2:
            mon.end_step()
    return json.loads(json.dumps(s.state_dict()))


@pytest.mark.parametrize("units", ["x", "2", -1, 0, True, 2.5, None, [1]])
def test_a_tampered_replica_count_is_refused_naming_it(units):
    # old: "2", -1, 0, True and 2.5 were accepted (a wrong count drops the run's measured steps and speeds with a
    # warning naming "0 replicas"), "x", None and [1] gave int()'s own ValueError / TypeError
    state = _state_after(4)
    state["monitor"]["units"] = units
    fresh = _sampler()
    BalanceMonitor(fresh, mode="adapt")
    with pytest.raises(ValueError, match='"units" must be a positive integer'):
        fresh.load_state_dict(state)


def test_an_old_state_with_malformed_measured_steps_is_refused():
    # old: a state without "units" whose first measured step has no times was taken as saved on 0 replicas
    state = _state_after(4)
    del state["monitor"]["units"]
    state["monitor"]["ledger"]["steps"][0]["measured"] = []
    fresh = _sampler()
    BalanceMonitor(fresh, mode="adapt")
    with pytest.raises(ValueError, match="malformed record"):
        fresh.load_state_dict(state)
