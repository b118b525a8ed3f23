"""Hostile arguments to BatchSteps, the stream's timeouts and the balanced trainers' options: wrong types, NaN,
infinities, negatives, zero, bools for integers. Each is refused with one line naming the argument (old: `dp_rank=nan`
raised int()'s "cannot convert float NaN to integer", `inf` an OverflowError, `dp_rank=1.0` was taken; a resume state
with `batches="3"` or `-1` was taken; `cp_method`, `attention_backend` and `filler_rows` took anything)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer.measured import BalanceMonitor
from balancer.measured.batches import BatchSteps
from balancer.streaming import BalancedStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

TOPO = balancer.Topology(dp=2, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)
HOSTILE = [True, False, math.nan, math.inf, -math.inf, -1, 2, 1.0, 0.5, "1", b"1", [0], None]


def _one_line(err: pytest.ExceptionInfo, name: str) -> None:
    text = str(err.value)
    assert "\n" not in text and name in text, text


@pytest.mark.parametrize("name", ["dp_rank", "rank"])
@pytest.mark.parametrize("value", [v for v in HOSTILE if v is not None])
def test_batch_steps_ranks(name, value):
    with pytest.raises(ValueError) as err:
        BatchSteps(TOPO, COST, **{name: value})
    _one_line(err, name)


@pytest.mark.parametrize("value", [math.nan, math.inf, 1.0, True])
def test_a_dp_rank_beside_a_good_rank_is_checked_too(value):
    with pytest.raises(ValueError) as err:
        BatchSteps(TOPO, COST, rank=0, dp_rank=value)
    _one_line(err, "dp_rank")


def test_numpy_integers_are_ranks():
    assert BatchSteps(TOPO, COST, dp_rank=np.int64(1)).dp_rank == 1
    assert BatchSteps(TOPO, COST, rank=np.int32(1)).pool_rank == 1


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.booleans(), st.text(max_size=3)))
@settings(max_examples=200, deadline=None)
def test_any_dp_rank_is_an_int_in_range_or_refused_naming_it(value):
    try:
        steps = BatchSteps(TOPO, COST, dp_rank=value)
    except ValueError as e:
        assert "dp_rank" in str(e) and "\n" not in str(e)
        return
    assert type(value) is int and 0 <= value < TOPO.dp and steps.dp_rank == value


@pytest.mark.parametrize("name", ["topology", "cost"])
@pytest.mark.parametrize("value", [None, 1, "x", math.nan])
def test_batch_steps_models(name, value):
    args = {"topology": TOPO, "cost": COST, name: value}
    with pytest.raises(TypeError) as err:
        BatchSteps(args["topology"], args["cost"], dp_rank=0)
    _one_line(err, name)


def _resumable() -> tuple[BatchSteps, dict]:
    steps = BatchSteps(balancer.Topology(dp=1, micro_batches=2, max_tokens=4096), COST, dp_rank=0)
    monitor = BalanceMonitor(steps, mode="shadow")
    plan = balancer.balance_batch(np.arange(20, 60), *steps.next_model(), mini_batches=2)
    steps.add(plan)
    for _ in range(plan.num_steps):
        monitor.record(0.01)
        monitor.record(0.01)
        monitor.end_step()
    state = steps.state_dict()
    fresh = BatchSteps(balancer.Topology(dp=1, micro_batches=2, max_tokens=4096), COST, dp_rank=0)
    BalanceMonitor(fresh, mode="shadow")
    return fresh, state


@pytest.mark.parametrize("key", ["batches", "steps"])
@pytest.mark.parametrize("value", [True, -1, 1.5, math.nan, math.inf, "3", None])
def test_batch_steps_resume_state_counts(key, value):
    steps, state = _resumable()
    with pytest.raises(ValueError) as err:
        steps.load_state_dict({**state, key: value})
    _one_line(err, key)


def test_batch_steps_resume_state_shape():
    steps, state = _resumable()
    for key in ("batches", "steps", "monitor"):
        with pytest.raises(ValueError, match=f"no '{key}'"):
            steps.load_state_dict({k: v for k, v in state.items() if k != key})
    with pytest.raises(ValueError, match="fewer than state\\['batches'\\]"):
        steps.load_state_dict({**state, "batches": state["steps"] + 1})
    with pytest.raises(ValueError, match="must be a dict"):
        steps.load_state_dict([state])  # type: ignore[arg-type]
    steps.load_state_dict(state)  # the real one still loads
    assert steps.batches == 1


@pytest.mark.parametrize("name", ["timeout", "close_timeout"])
@pytest.mark.parametrize("value", [True, math.nan, math.inf, -1, 0, 0.0, "5", None])
def test_stream_timeouts(name, value):
    with pytest.raises(ValueError) as err:
        BalancedStream(doc_rows(20, 0), balancer.Topology(dp=1), COST, window_docs=8, **{name: value})
    _one_line(err, name)


@pytest.mark.parametrize("value", [True, math.nan, -1, 0, "5"])
def test_close_timeout_argument(value):
    with BalancedStream(doc_rows(20, 0), balancer.Topology(dp=1), COST, window_docs=8) as stream:
        with pytest.raises(ValueError) as err:
            stream.close(value)
        _one_line(err, "timeout")
    stream.close(1)  # closed by the with: idempotent


def test_trainer_options():
    from attention.backends.select import BACKENDS
    from attention.cp import METHODS
    from balancer.trainers.options import check_trainer_options

    good = {"cp_method": "ring", "attention_backend": "auto", "filler_rows": False}
    for method in METHODS:
        check_trainer_options(**{**good, "cp_method": method})
    for backend in BACKENDS:
        check_trainer_options(**{**good, "attention_backend": backend})
    check_trainer_options(**{**good, "filler_rows": True})
    for name in good:
        for value in [math.nan, math.inf, -1, 0, 1, None, "1", ["ring"], *([1, 0] if name == "filler_rows" else [])]:
            with pytest.raises(ValueError) as err:
                check_trainer_options(**{**good, name: value})
            _one_line(err, name)
