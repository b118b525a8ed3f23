"""BalanceMonitor on real spawned gloo worlds: the refit is identical on every rank (one rank fits, the
coefficients travel with the gather) and recovers uneven replica speeds; a replica's micro-batch time is the
slowest of its CP ranks; a rank that dies or stalls before the gather gives a clear error within the timeout."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch.distributed
from support.dist import run_world

import balancer
from balancer.measured import BalanceMonitor
from balancer.measured.monitor import _planner_takes_speeds

pytestmark = pytest.mark.slow  # spawned gloo worlds

FLOPS = balancer.CostModel(attn_coef=1.0, linear_coef=10.0)
LENGTHS = np.random.default_rng(0).integers(20, 400, 900)
SPEEDS = (1.0, 0.5, 0.5)


def _fake(mb, lengths):
    from test_monitor import fake_seconds  # tests/measured is on the path of spawned ranks through sys.path below

    return fake_seconds(mb, lengths)


def _train(sampler, monitor, factor):
    m = sampler.topology.micro_batches
    mine = []
    for i, mb in enumerate(sampler):
        t = _fake(mb, sampler.lengths) * factor(i // m, i % m)
        mine.append(t)
        monitor.record(t)
        if i % m == m - 1:
            monitor.end_step()
    return mine


def _uneven(rank, world, out):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    topo = balancer.Topology(dp=3, micro_batches=2, max_tokens=1024, tokens_per_step=2400)
    s = balancer.BalancedBatchSampler(LENGTHS, topo, FLOPS, seed=0, window_docs=180)
    mon = BalanceMonitor(s, mode="adapt")
    _train(s, mon, lambda step, m: 1.0 / SPEEDS[rank] * (1 + 0.01 * rank))  # ranks differ in the last bits too
    rep = mon.report()
    models = [{"cost": {k: float(v).hex() if isinstance(v, float) else v for k, v in m.cost.to_dict().items()},
               "speeds": None if m.speeds is None else [float(x).hex() for x in m.speeds], "start": list(m.start)}
              for m in mon.models]  # fmt: skip
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"models": models, "report": rep, "planned": [s.windows.model(w)[1].to_dict() for w in
                   range(s.num_windows)]}, f)  # fmt: skip


def test_refit_is_identical_on_every_rank_and_finds_the_speeds(tmp_path):
    run_world(3, _uneven, str(tmp_path))
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert got[0]["models"] == got[1]["models"] == got[2]["models"]
    assert got[0]["planned"] == got[1]["planned"] == got[2]["planned"]
    assert len(got[0]["models"]) >= 3  # the sampler's model and at least two accepted refits
    rep = got[0]["report"]
    want = np.array(SPEEDS) * np.array([1, 1 / 1.01, 1 / 1.02]) / np.mean(SPEEDS)
    assert np.array(rep["rank_speeds"]) / np.mean(rep["rank_speeds"]) == pytest.approx(want / want.mean(), rel=0.03)
    assert rep["fresh_error_median"] < 0.03 and rep["fresh_error_p90"] < 0.06
    series = rep["series"]
    t = np.array(series["measured"])
    imb = t.max(axis=1) / t.mean(axis=1)
    w = np.array(series["window"])
    assert imb[w < 2].mean() > 1.15  # planned without speeds: the slow replicas wait for nobody, rank 0 waits
    if _planner_takes_speeds():  # windows from 2 on were planned with the fitted speeds
        assert imb[w >= 3].mean() < imb[w < 2].mean() - 0.05
    assert 0 < rep["idle_fraction"] < 1


def _cp(rank, world, out):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=512, tokens_per_step=3000)
    s = balancer.BalancedBatchSampler(LENGTHS[:400], topo, FLOPS, seed=0, window_docs=100)
    mon = BalanceMonitor(s, mode="shadow")
    mine = _train(s, mon, lambda step, m: 1.0 + 0.3 * ((rank + step + m) % 2))  # CP ranks alternate being slower
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"mine": mine, "steps": mon.ledger.steps, "dp_rank": s.dp_rank}, f)


def test_a_replica_takes_the_slowest_of_its_cp_ranks(tmp_path):
    run_world(4, _cp, str(tmp_path))
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert got[0]["steps"] == got[1]["steps"] == got[2]["steps"] == got[3]["steps"]
    for r in range(2):
        a, b = (np.array(got[k]["mine"]).reshape(-1, 2) for k in (2 * r, 2 * r + 1))
        want = np.maximum(a, b).sum(axis=1)
        assert [st["measured"][r] for st in got[0]["steps"]] == pytest.approx(want.tolist(), rel=1e-12)
        assert [st["ranks"][2 * r] for st in got[0]["steps"]] == pytest.approx(a.sum(axis=1).tolist(), rel=1e-12)


def _dies(rank, world, out, stall):
    topo = balancer.Topology(dp=2, micro_batches=1, max_tokens=1024, tokens_per_step=1500)
    s = balancer.BalancedBatchSampler(LENGTHS[:200], topo, FLOPS, seed=0)
    mon = BalanceMonitor(s, timeout=3.0)
    it = iter(s)
    next(it)  # plans the epoch: ranks may take different times on a loaded machine
    torch.distributed.barrier()  # so the good step's gather below is within the short timeout
    mon.record(0.01)
    mon.end_step()  # one good step
    next(it)
    mon.record(0.01)
    if rank == 1:
        if not stall:
            os._exit(0)  # dies before the gather
        time.sleep(25)  # far past rank 0's timeout, even on a loaded machine
    t0 = time.perf_counter()
    try:
        mon.end_step()
        msg = None
    except RuntimeError as e:
        msg = str(e)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"error": msg, "seconds": time.perf_counter() - t0}, f)
    os._exit(0)  # the group is broken: no barrier, no teardown


@pytest.mark.parametrize("stall", [False, True], ids=["dies", "stalls"])
def test_a_rank_that_dies_or_stalls_gives_a_clear_error(tmp_path, stall):
    run_world(2, _dies, str(tmp_path), stall)
    got = json.loads((tmp_path / "0.json").read_text())
    assert got["error"] is not None and "gather of step 1 (epoch 0) failed on rank 0" in got["error"]
    assert "a rank died or did not reach end_step within timeout=3 s" in got["error"]
    assert got["seconds"] < 20.0  # the 3 s timeout, not the 25 s stall
