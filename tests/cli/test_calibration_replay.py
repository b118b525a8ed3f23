"""benchmarks/replay.py bookkeeping: a plan becomes the steps the worker trains (every replica M micro-batches, every
document once), per-rank timings reduce to step and micro-batch times the way the cost model predicts them, and the
ranking verdict is computed from the figures (a wrong prediction is reported as wrong)."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import balancer  # noqa: E402
from balancer.data.traces import sft_mix  # noqa: E402

replay = __import__("replay")


def test_step_payload_holds_every_document_once_per_replica_slot():
    lengths = sft_mix(400, seed=1)
    topo = balancer.Topology(dp=2, cp=2, micro_batches=3, max_tokens=2048)
    plan = balancer.plan(lengths, topo, balancer.CostModel(attn_coef=1e-8, linear_coef=1e-5), seed=0)
    payload = replay.step_payload(plan, "hybrid")
    assert payload["layout"] == "hybrid" and len(payload["steps"]) == plan.num_steps
    assert all(len(step) == 2 and all(len(replica) == 3 for replica in step) for step in payload["steps"])
    flat = sorted(d for step in payload["steps"] for replica in step for mb in replica for d in mb)
    assert flat == sorted((plan.end - plan.start).tolist()) and sum(flat) == int(lengths.sum())
    docs = [sum(len(mb) for replica in step for mb in replica) for step in payload["steps"]]
    assert payload["tokens"] == [sum(sum(mb) for r in step for mb in r) - n for step, n in zip(payload["steps"], docs)]


def test_measured_times_take_the_slowest_cp_rank_and_replica():
    # dp 2 x cp 2, M = 2, one step: rank = replica * cp + cp_rank
    micro = {0: [1.0, 2.0], 1: [1.5, 1.0], 2: [3.0, 0.5], 3: [2.0, 0.7]}
    per_rank = [
        [{"micro_batches": [[m, m / 2] for m in micro[r]], "all_reduce": [0.1, 0.05], "optimizer": [0.2, 0.1],
          "step": [4.0 + r, 2.0]}]
        for r in range(4)
    ]  # fmt: skip
    wall = replay.measured_times(per_rank, dp=2, cp=2, clock=0)
    assert np.allclose(wall["micro_batch"][0], [[1.5, 2.0], [3.0, 0.7]])  # max over each replica's CP ranks
    assert np.allclose(wall["compute"], [3.7]) and np.allclose(wall["step"], [7.0])
    assert np.allclose(replay.measured_times(per_rank, 2, 2, clock=1)["micro_batch"][0], [[0.75, 1.0], [1.5, 0.35]])


def test_ranking_verdict_is_computed():
    def row(measured, predicted, wall=None):
        return {
            "epoch_seconds": measured,
            "compute_seconds": measured,
            "predicted_compute_seconds": predicted,
            "epoch_cpu_seconds": measured,
            "epoch_wall_seconds": 4 * measured if wall is None else wall,
        }

    right = replay.compare({"a": row(10.0, 9.0), "b": row(12.0, 11.0), "trl-bfd": row(15.0, 14.0)}, "trl-bfd")
    assert right["ranking_correct"] and right["ranking_measured"] == ["a", "b", "trl-bfd"]
    assert right["rows"]["a"]["measured_speedup"] == 1.5
    assert right["rows"]["a"]["measured_speedup_cpu"] == 1.5 and right["rows"]["a"]["measured_speedup_wall"] == 1.5
    # the clocks apart: by wall clock "a" waited longest for a core, so it ranks last there and its speedup is < 1
    clocks = replay.compare({"a": row(10.0, 9.0, wall=70.0), "trl-bfd": row(15.0, 14.0, wall=60.0)}, "trl-bfd")
    assert clocks["rows"]["a"]["measured_speedup_cpu"] == 1.5
    assert abs(clocks["rows"]["a"]["measured_speedup_wall"] - 60 / 70) < 1e-12
    assert clocks["ranking_measured"] == ["a", "trl-bfd"] and clocks["ranking_measured_wall"] == ["trl-bfd", "a"]
    wrong = replay.compare({"a": row(10.0, 11.5), "b": row(12.0, 11.0), "trl-bfd": row(15.0, 14.0)}, "trl-bfd")
    assert not wrong["ranking_correct"] and wrong["ranking_predicted"] == ["b", "a", "trl-bfd"]
