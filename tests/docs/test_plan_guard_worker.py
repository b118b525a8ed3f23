"""benchmarks/_guard_worker.py, one side of plan_guard: it plans with the checkout it is given (and refuses any
other), `best_of` plans of a shape give the same plan as one, and its digest is the plan's placements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import balancer

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "benchmarks" / "_guard_worker.py"
TOPOLOGY = {"dp": 2, "cp": 1, "pp": 1, "micro_batches": 2, "max_tokens": 2048}
COST = {"attn_coef": 1e-4, "linear_coef": 1.0}


def _job(tmp_path: Path, best_of: int) -> Path:
    lengths = np.clip(np.random.default_rng(3).lognormal(np.log(500), 0.8, 600), 16, 2048).astype(np.int64)
    np.save(tmp_path / "small.npy", lengths)
    shape = {"name": "small", "kind": "plan", "data": "small", "topology": TOPOLOGY, "cost": COST, "seed": 0}
    job = tmp_path / f"job{best_of}.json"
    job.write_text(json.dumps({"data": str(tmp_path), "shapes": [shape | {"best_of": best_of}]}))
    return job


def _run(job: Path, root: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(WORKER), str(job), str(root)], env=env, capture_output=True, text=True)


def test_best_of_plans_the_same_and_matches_an_in_process_plan(tmp_path):
    once, best = (json.loads(_run(_job(tmp_path, k), ROOT).stdout.splitlines()[-1])["small"] for k in (1, 3))
    assert once["digest"] == best["digest"] and 0 < best["cpu_s"] and once["imbalance"] == best["imbalance"]
    lengths = np.load(tmp_path / "small.npy")
    plan = balancer.plan(lengths, balancer.Topology(**TOPOLOGY), balancer.CostModel(**COST), seed=0)
    assert once["steps"] == plan.metrics()["steps"] and once["imbalance"] == plan.metrics()["imbalance"]


def test_the_worker_refuses_a_balancer_from_another_checkout(tmp_path):
    done = _run(_job(tmp_path, 1), tmp_path)
    assert done.returncode != 0 and "not from" in done.stderr
