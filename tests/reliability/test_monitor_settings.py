"""Ranks whose monitors disagree on a setting that shapes plans stop at the first end_step, every rank, with one
line naming the setting (old: they planned different windows and lost or repeated documents with no error)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support.dist import run_world

import balancer
from balancer.measured import BalanceMonitor
from balancer.measured.settings import check_settings_agree, plan_settings

COST = balancer.CostModel(attn_coef=1.0, linear_coef=10.0)
LENGTHS = np.random.default_rng(0).integers(20, 400, 600)
TOPO = balancer.Topology(dp=2, micro_batches=2, max_tokens=1024, tokens_per_step=1600)

# setting -> (what rank 1 changes, the name in the error)
CASES = {
    "mode": ({"mode": "adapt"}, "mode"),
    "every": ({"every": 2}, "every"),
    "seed": ({"seed": 1}, "seed"),
    "window_docs": ({"window_docs": 120}, "window size"),
    "rank_speeds": ({"speeds": (1.0, 2.0)}, "rank_speeds"),
    "cost": ({"cost": balancer.CostModel(attn_coef=2.0, linear_coef=10.0)}, "cost model"),
}


def _monitor(changes: dict, rank: int):
    mine = changes if rank == 1 else {}
    topo = TOPO if "speeds" not in mine else balancer.Topology(**{**TOPO.__dict__, "rank_speeds": mine["speeds"]})
    sampler = balancer.BalancedBatchSampler(
        LENGTHS, topo, mine.get("cost", COST), dp_rank=rank, seed=mine.get("seed", 0),
        window_docs=mine.get("window_docs", 60),
    )  # fmt: skip
    return sampler, BalanceMonitor(sampler, mode=mine.get("mode", "shadow"), every=mine.get("every", 1), cuda=False)


def _run(rank, world, case, out):
    changes, _ = CASES[case]
    sampler, mon = _monitor(changes, rank)
    result = {"error": None, "steps": 0}
    try:
        for i, _mb in enumerate(sampler):
            mon.record(0.01)
            if i % TOPO.micro_batches == TOPO.micro_batches - 1:
                mon.end_step()
                result["steps"] += 1
                if result["steps"] == 3:
                    break
    except ValueError as e:
        result["error"] = str(e)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.slow  # spawned gloo worlds
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_disagree_stop_naming_the_setting(tmp_path, case):
    run_world(2, _run, case, str(tmp_path))
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["error"] is not None and r["steps"] == 0, results  # stopped at the first end_step, on both
        assert CASES[case][1] in r["error"] and "ranks [0] vs [1]" in r["error"], r["error"]
        assert "\n" not in r["error"]


def test_one_process_checks_nothing_and_settings_name_what_shapes_plans():
    sampler = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, seed=0, window_docs=60)
    mon = BalanceMonitor(sampler, mode="shadow", cuda=False)
    names = plan_settings(mon, (0, False, [[1]], None))
    for key in ("mode", "every", "rank_speeds", "cost model", "seed", "window size (window_docs)"):
        assert key in names
    assert names["seed"] == "0" and names["window size (window_docs)"] == "60"
    check_settings_agree(names, None, 1, 1.0)  # world 1: no collective, nothing to disagree with
