"""BatchSteps: the monitor on loops that plan one fixed batch at a time with `balance_batch`. A fit after batch b plans
batch b + 2 on, the same bits on every rank, and finds the replicas' speeds; shadow keeps the first model; resume
continues with the model the uninterrupted run had; bad batches are refused naming the argument."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support.dist import run_world

import balancer
from balancer.measured import BalanceMonitor
from balancer.measured.batches import BatchSteps
from balancer.measured.monitor import _planner_takes_speeds

TRUE = balancer.CostModel(attn_coef=2e-7, linear_coef=3e-5, fixed=1e-3)
FLOPS = balancer.CostModel(attn_coef=1.0, linear_coef=10.0)
SPEEDS = (1.0, 0.5, 0.5)


def _batch(b: int, dp: int = 1) -> np.ndarray:
    """Batches of short and of long documents by turns: their attention shares differ, which a fit needs."""
    rng = np.random.default_rng(1000 + b)
    return rng.integers(20, 400, 64 * dp) if b % 2 else rng.integers(1000, 3000, 16 * dp)


def _seconds(plan, step: int, dp_rank: int, m: int, slow: float) -> float:
    k = step * plan.topology.bins_per_step + dp_rank * plan.step_micro_batches(step) + m
    a, z = int(plan.mb_ptr[k]), int(plan.mb_ptr[k + 1])
    sizes = plan.end[a:z] - plan.start[a:z]
    wobble = 1 + 0.02 * np.sin(1.7 * k + 0.3 * step + int(sizes.sum()))  # deterministic 'noise'
    return float(TRUE.micro_batch_cost(sizes) * wobble / slow)


def _loop(steps: BatchSteps, monitor: BalanceMonitor, batches: range, slow: float = 1.0) -> list:
    """Plan and 'train' `batches`; returns each batch's (topology speeds, cost) as planned."""
    used = []
    for b in batches:
        topo, cost = steps.next_model()
        used.append((topo.rank_speeds, cost.to_dict()))
        plan = balancer.balance_batch(_batch(b, topo.dp), topo, cost, mini_batches=2)
        steps.add(plan)
        for s in range(plan.num_steps):
            for m in range(plan.step_micro_batches(s)):
                monitor.record(_seconds(plan, s, steps.dp_rank, m, slow))
            monitor.end_step()
    return used


def _single(mode: str = "adapt"):
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=16384)
    steps = BatchSteps(topo, FLOPS, dp_rank=0)
    return steps, BalanceMonitor(steps, mode=mode, min_samples=12)


def test_a_fit_after_batch_b_plans_batch_b_plus_2_on():
    steps, mon = _single()
    used = _loop(steps, mon, range(12))
    accepted = [r for r in mon.refits if r["accepted"]]
    assert accepted, mon.refits
    first = accepted[0]["first"][1]  # the batch the first accepted fit plans
    assert first == accepted[0]["window"] + 2
    assert all(u[1] == FLOPS.to_dict() for u in used[:first])
    assert used[first][1] != FLOPS.to_dict()
    assert used[-1][1]["attn_coef"] == pytest.approx(TRUE.attn_coef, rel=0.3)
    rep = mon.report()
    assert rep["steps"] == 24 and rep["fresh_error_median"] < 0.05


def test_shadow_keeps_the_first_model_and_still_fits():
    steps, mon = _single("shadow")
    used = _loop(steps, mon, range(8))
    assert all(u[1] == FLOPS.to_dict() for u in used)
    assert any(r["accepted"] for r in mon.refits)


def test_resume_plans_what_the_uninterrupted_run_would_have():
    steps, mon = _single()
    full = _loop(steps, mon, range(10))
    a, ma = _single()
    _loop(a, ma, range(5))
    state = json.loads(json.dumps(a.state_dict()))
    b, mb = _single()
    b.load_state_dict(state)
    mb.warmup_steps = 0  # the evidence after the cut: as in the uninterrupted run, which is past its warm-up
    assert b.batches == 5 and mb.models == ma.models
    assert _loop(b, mb, range(5, 10)) == full[5:]


def test_bad_batches_are_refused():
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=16384)
    steps = BatchSteps(topo, FLOPS, dp_rank=0)
    plan = balancer.balance_batch(_batch(0), topo, FLOPS)
    with pytest.raises(ValueError, match="build the BalanceMonitor"):
        steps.add(plan)
    BalanceMonitor(steps)
    with pytest.raises(ValueError, match="micro_batches = 4, the monitor's topology 2"):
        steps.add(balancer.balance_batch(_batch(0), topo, FLOPS, micro_batches=4))
    with pytest.raises(TypeError, match="plan must be a balancer Plan"):
        steps.add([[1, 2]])
    with pytest.raises(TypeError, match="cost must be a CostModel"):
        BatchSteps(topo, "flops", dp_rank=0)
    dyn = BatchSteps(balancer.Topology(dp=2, cp_sizes=(1, 2), micro_batches=2, max_tokens=16384), FLOPS, rank=0)
    BalanceMonitor(dyn)
    with pytest.raises(ValueError, match="cp_sizes = None, the monitor's topology"):
        dyn.add(balancer.balance_batch(_batch(0), balancer.Topology(dp=2, micro_batches=2, max_tokens=16384), FLOPS,
                                       micro_batches=2))  # fmt: skip


def _uneven(rank, world, out):
    topo = balancer.Topology(dp=3, micro_batches=2, max_tokens=16384)
    steps = BatchSteps(topo, FLOPS)  # the rank from torch.distributed
    mon = BalanceMonitor(steps, mode="adapt")
    used = _loop(steps, mon, range(14), slow=SPEEDS[rank] * (1 + 0.01 * rank))  # ranks differ in the last bits
    hexed = [(None if s is None else [float(x).hex() for x in s], {k: float(v).hex() if isinstance(v, float) else v
              for k, v in c.items()}) for s, c in used]  # fmt: skip
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"used": hexed, "report": mon.report()}, f)


@pytest.mark.slow  # a spawned gloo world
def test_every_rank_plans_each_batch_with_the_same_bits_and_the_speeds_are_found(tmp_path):
    run_world(3, _uneven, str(tmp_path))
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert got[0]["used"] == got[1]["used"] == got[2]["used"]
    rep = got[0]["report"]
    want = np.array(SPEEDS) * np.array([1, 1.01, 1.02])
    assert np.array(rep["rank_speeds"]) / np.mean(rep["rank_speeds"]) == pytest.approx(want / want.mean(), rel=0.05)
    if _planner_takes_speeds():
        assert got[0]["used"][-1][0] is not None  # the last batches were planned with the fitted speeds


def _dynamic(rank, world, out):
    from balancer.measured.refit import fit, predict

    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=4096, cp_sizes=(1, 2, 4))
    steps = BatchSteps(topo, FLOPS)  # the pool rank from torch.distributed
    monitor = BalanceMonitor(steps, mode="adapt", min_samples=16)
    slow = 0.5 if rank == 3 else 1.0
    for b in range(6):
        topo_b, cost_b = steps.next_model()
        rng = np.random.default_rng(2000 + b)  # long documents (above max_tokens: groups of 2 or 4) among short ones
        lengths = np.concatenate([rng.integers(20, 400, 200), rng.integers(4200, 6000, 2)])
        plan = balancer.balance_batch(lengths, topo_b, cost_b, mini_batches=4)
        steps.add(plan)
        first = steps.position // topo.micro_batches - plan.num_steps
        for s in range(plan.num_steps):
            for m in range(plan.step_micro_batches(s)):
                pieces = steps.micro_batch(first + s, m, rank=rank)
                sizes = np.array([p.end - p.start for p in pieces], dtype=np.int64)
                size = pieces[0].group.size if pieces else 1
                t = float(predict(TRUE, [sizes], np.array([size]))[0]) if len(sizes) else 1e-4
                monitor.record(t * (1 + 0.01 * np.sin(7 * s + m + b)) / slow)
            monitor.end_step()
    models = [(x.cost.to_dict(), x.speeds) for x in monitor.models]
    refit = fit(monitor.ledger.evidence(), FLOPS, 4)[1].tolist()  # the refit on all the evidence kept
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"models": models, "speeds": monitor.report()["rank_speeds"], "refit": refit,
                   "planned": steps.next_model()[0].rank_speeds,
                   "sizes": sorted({int(r[8]) for r in monitor.ledger.mb})}, f)  # fmt: skip


def test_dynamic_cp_batches_fit_pool_rank_speeds(tmp_path):
    run_world(4, _dynamic, str(tmp_path))
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert got[0] == got[1] == got[2] == got[3]
    assert 1 in got[0]["sizes"] and max(got[0]["sizes"]) > 1  # groups of one rank and of several
    want = np.array([1.0, 1.0, 1.0, 0.5]) / 0.875
    assert np.array(got[0]["refit"]) == pytest.approx(want, rel=0.03)  # groups charged to their slowest member
    speeds = np.array(got[0]["speeds"])  # the last accepted fit (later ones may be refused on few held-back steps)
    assert speeds[3] < 0.85 * speeds[:3].min()
    if _planner_takes_speeds():
        planned = got[0]["planned"]
        assert planned is not None and len(planned) == 4 and planned[3] < min(planned[:3])
