"""balance_batch on large batches (the near-linear path of balancer.planning.batch.large): the same promises as on
small ones (every document exactly once, caps, equal micro-batch counts, groups kept, equal counts within one,
deterministic) and a balance as close to the bound, at a CPU cost far from quadratic."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
import balancer.planning.batch.pack as pack

COST = balancer.CostModel(attn_coef=1 / 2000, linear_coef=1.0)
ROOT = Path(__file__).resolve().parents[2]


def _check(plan, lengths, groups, keep, equal_counts, k):
    plan.validate()  # exactly once, non-empty micro-batches, every one within max_tokens * cp
    t = plan.topology
    assert plan.num_steps == k and plan.num_docs == len(lengths)
    tok = plan.micro_batch_tokens()
    assert tok.max() <= t.micro_batch_tokens
    assert tok.shape[1:] == (t.dp, t.micro_batches) and tok.min() > 0
    mb = np.repeat(np.arange(len(plan.mb_ptr) - 1), np.diff(plan.mb_ptr))
    if groups is not None:
        place = (mb // t.micro_batches) % t.dp if keep == "rank" else mb
        where = {}
        for g, s, p in zip(groups[plan.doc], mb // t.bins_per_step, place):
            where.setdefault(int(g), set()).add((int(s), int(p)))
        assert all(len(v) == 1 for v in where.values())
    if equal_counts:
        counts = np.diff(plan.mb_ptr).reshape(k, t.dp, t.micro_batches).sum(axis=2)
        assert (counts.max(axis=1) - counts.min(axis=1)).max() <= 1


@pytest.mark.slow  # hypothesis: ~20 s
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {
            "n_groups": st.integers(16, 120),
            "group_size": st.sampled_from([1, 2, 4]),
            "dp": st.integers(1, 4),
            "cp": st.sampled_from([1, 2]),
            "pp": st.sampled_from([1, 3]),
            "m": st.integers(1, 3),
            "k": st.integers(1, 2),
            "keep": st.sampled_from(["rank", "micro_batch", None]),
            "equal_counts": st.booleans(),
            "seed": st.integers(0, 3),
        }
    )
)
def test_large_path_keeps_every_promise(cfg):
    """The large path on small batches (its threshold lowered to 1 unit), so hypothesis can try many shapes."""
    rng = np.random.default_rng(cfg["seed"])
    n = cfg["n_groups"] * cfg["group_size"]
    lengths = np.minimum(rng.lognormal(4.5, 1.0, n).astype(int) + 1, 400)
    groups = None if cfg["keep"] is None else np.repeat(np.arange(cfg["n_groups"]), cfg["group_size"])
    topo = balancer.Topology(dp=cfg["dp"], cp=cfg["cp"], pp=cfg["pp"], micro_batches=cfg["m"], max_tokens=1600)
    k = cfg["k"] if cfg["dp"] * cfg["m"] * cfg["k"] <= cfg["n_groups"] else 1
    if cfg["dp"] * cfg["m"] * k > cfg["n_groups"]:
        return
    kwargs = dict(groups=groups, keep=cfg["keep"] or "rank", mini_batches=k, seed=cfg["seed"], micro_batches="auto")
    kwargs["equal_counts"] = cfg["equal_counts"]
    saved = pack.LARGE_UNITS
    pack.LARGE_UNITS = 1
    try:
        try:
            plan = balancer.balance_batch(lengths, topo, COST, **kwargs)
        except ValueError as error:  # groups that cannot be dealt evenly over the ranks, as on the small path
            assert "equal_counts" in str(error) and cfg["equal_counts"] and cfg["group_size"] > 1, error
            return
        again = balancer.balance_batch(lengths, topo, COST, **kwargs)
    finally:
        pack.LARGE_UNITS = saved
    _check(plan, lengths, groups, kwargs["keep"], cfg["equal_counts"], k)
    assert np.array_equal(again.doc, plan.doc) and np.array_equal(again.mb_ptr, plan.mb_ptr)


def grpo(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n rollouts, 8 per prompt: prompts 200-1500 tokens, responses log-normal (median 1500) up to 14000."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(200, 1500, n // 8)
    response = np.minimum(rng.lognormal(np.log(1500), 1.0, (n // 8, 8)), 14000).astype(np.int64) + 1
    return (prompt[:, None] + response).ravel(), np.repeat(np.arange(n // 8), 8)


@pytest.mark.parametrize("options", [{}, {"keep": "rank", "grouped": True}, {"equal_counts": True}])
def test_large_batches_stay_at_the_bound(options):
    """4,096 rollouts on dp8: the large path's plan within 1e-4 of the bound (the exact search's was within 1e-6
    on these batches, in 3-15 s of CPU; benchmarks/balance_batch_speed.py compares them)."""
    options = dict(options)
    lengths, groups = grpo(4096)
    groups = groups if options.pop("grouped", False) else None
    topo = balancer.Topology(dp=8, max_tokens=16384)
    plan = balancer.balance_batch(lengths, topo, COST, groups=groups, micro_batches="auto", **options)
    _check(plan, lengths, groups, options.get("keep", "rank"), options.get("equal_counts", False), 1)
    assert plan.metrics()["imbalance"] < 1 + 1e-4


CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
import balancer
from test_balance_batch_large import COST, grpo
lengths, groups = grpo(16384)
started = time.process_time()
plan = balancer.balance_batch(lengths, balancer.Topology(dp=8, max_tokens=16384), COST, groups=groups,
                              keep="rank", micro_batches="auto")
print(json.dumps({"cpu": time.process_time() - started, "imbalance": plan.metrics()["imbalance"]}))
"""


def test_sixteen_thousand_rollouts_plan_in_seconds_not_minutes():
    """A GRPO batch of 16K rollouts on dp8 under a 60 s CPU limit (the quadratic search took minutes); the goal,
    <= 0.5 s, is measured by the benchmark on a quiet machine, so the test allows 10x for shared CI machines."""

    def limit():
        resource.setrlimit(resource.RLIMIT_CPU, (60, 60))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limit,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["cpu"] < 5.0 and result["imbalance"] < 1 + 1e-4, result
