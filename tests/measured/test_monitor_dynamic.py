"""BalanceMonitor with dynamic CP on a real 4-rank gloo world (dp 2 x cp 2, CP groups of 1, 2 and 4 pool ranks):
a group's micro-batch takes its slowest member's time, the refit (identical on every rank) finds a slow pool rank,
adapt plans the later windows with pool-rank speeds, and every token is still trained exactly once."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from support.coverage import covered_tokens
from support.dist import run_world

import balancer
from balancer.measured import BalanceMonitor
from balancer.measured.monitor import _planner_takes_speeds
from balancer.measured.refit import predict
from balancer.training.indices import Span

pytestmark = pytest.mark.slow  # a spawned gloo world

TRUE = balancer.CostModel(attn_coef=2e-7, linear_coef=3e-5, fixed=1e-3)
FLOPS = balancer.CostModel(attn_coef=1.0, linear_coef=10.0)
SPEEDS = (1.0, 1.0, 1.0, 0.5)  # pool rank 3 runs at half speed
_rng = np.random.default_rng(1)
LENGTHS = np.concatenate([_rng.integers(20, 300, 700), _rng.integers(1500, 3000, 12)])[_rng.permutation(712)]
TOPO = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=1024, tokens_per_step=2600, cp_sizes=(1, 2, 4))


def _seconds(mb, rank: int) -> float:
    """This rank's 'measured' time of its group's micro-batch: the true model under the zigzag layout, the group's
    size, 2% noise keyed by the documents, divided by the rank's speed."""
    sizes = [(i.end - i.start) if isinstance(i, Span) else int(LENGTHS[i]) for i in mb]
    size = mb[0].group.size if len(mb) else 1
    u = zlib.crc32(repr([int(getattr(i, "doc", i)) for i in mb]).encode()) / 2**32 - 0.5
    return float(predict(TRUE, [np.array(sizes, dtype=np.int64)], np.array([size]))[0]) * (1 + 0.04 * u) / SPEEDS[rank]


def _world(rank, world, out):
    s = balancer.BalancedBatchSampler(LENGTHS, TOPO, FLOPS, rank=rank, seed=0, window_docs=120)
    mon = BalanceMonitor(s, mode="adapt")
    m, mine, led = TOPO.micro_batches, [], []
    for i, mb in enumerate(s):
        t = _seconds(mb, rank)
        group = mb[0].group if len(mb) else None
        mine.append([i // m, i % m, t, None if group is None else [group.start, group.size]])
        if group is None or group.rank == 0:  # the group's first rank keeps its pieces: the coverage check
            led.extend([i.doc, i.start, i.end] if isinstance(i, Span) else [int(i), -1, -1] for i in mb)
        mon.record(t)
        if i % m == m - 1:
            mon.end_step()
    mon.flush()
    models = [
        {
            "cost": {k: float(v).hex() if isinstance(v, float) else v for k, v in x.cost.to_dict().items()},
            "speeds": None if x.speeds is None else [float(v).hex() for v in x.speeds],
        }
        for x in mon.models
    ]
    planned = [list(s.windows.model(w)[0].rank_speeds or []) for w in range(s.num_windows)]  # fmt: skip
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"models": models, "report": mon.report(), "mine": mine, "pieces": led, "planned": planned,
                   "mb": mon.ledger.mb}, f)  # fmt: skip


def test_dynamic_cp_groups_are_measured_and_pool_rank_speeds_planned(tmp_path):
    run_world(4, _world, str(tmp_path))
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert got[0]["models"] == got[1]["models"] == got[2]["models"] == got[3]["models"]
    assert got[0]["planned"] == got[1]["planned"] == got[2]["planned"] == got[3]["planned"]
    assert got[0]["mb"] == got[3]["mb"]
    # a group's micro-batch took its slowest member's time, every member's entry the same
    recorded = {(r, step, m): (t, g) for r in range(4) for step, m, t, g in got[r]["mine"]}
    sizes = set()
    for _model, unit, seconds, _units, serial, _out, m, start, size in got[0]["mb"]:
        assert recorded[(unit, serial, m)][1] in ([start, size], None)  # the ledger has the plan's group
        sizes.add(size)
        assert seconds == pytest.approx(max(recorded[(k, serial, m)][0] for k in range(start, start + size)))
    assert {1, 2} <= sizes  # the plans used groups of one rank and of several
    rep = got[0]["report"]
    want = np.array(SPEEDS) / np.mean(SPEEDS)
    assert np.array(rep["rank_speeds"]) == pytest.approx(want, rel=0.03)  # groups charged to their slowest member
    assert rep["fresh_error_median"] < 0.03 and rep["fresh_error_p90"] < 0.06
    if _planner_takes_speeds():  # the windows from two after the first accepted fit on have pool-rank speeds
        planned = got[0]["planned"]
        assert not planned[0] and not planned[1] and len(planned[-1]) == 4 and planned[-1][3] < planned[-1][0]
        t, w = np.array(rep["series"]["measured"]), np.array(rep["series"]["window"])
        imb = t.max(axis=1) / t.mean(axis=1)  # pool ranks' busy time per step
        assert imb[w >= 3].mean() < imb[w < 2].mean() - 0.05
    pieces = [tuple(p) for r in range(4) for p in got[r]["pieces"]]
    items = [Span(d, a, z) if a >= 0 else d for d, a, z in pieces]
    assert covered_tokens(items, LENGTHS) == covered_tokens(range(len(LENGTHS)), LENGTHS)
