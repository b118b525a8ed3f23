"""compare.py --seeds: the equal-slices comparison over several seeds (benchmarks/compare.py, peers_pkg.py)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

peers_pkg = pytest.importorskip("peers_pkg")


def _run(seed: int, mine: float, hf: float, verl: float | None) -> dict:
    peers = {
        "balancer_slices": {"status": "ok", "epoch_efficiency": 1 / (1 + mine), "imbalance": 1.0},
        "hf_rebalance": {"status": "ok", "epoch_efficiency": 1 / (1 + hf), "imbalance": 1.0},
        "verl_pkg": {"status": "failed: x"} if verl is None else {"status": "ok", "epoch_efficiency": 1 / (1 + verl),
                                                                  "imbalance": 1.0},
        "balancer": {"status": "ok", "epoch_efficiency": 1.0, "imbalance": 1.0, "step_time_total": 1.0,
                     "lower_bound_epoch": 1.0},
    }  # fmt: skip
    row = dict(seed=seed, distribution="sft", topology="dp4 M4", peers=peers)
    peers_pkg.score_row(row)
    return row


def test_seed_summary_takes_the_best_slice_peer_per_seed_and_the_worst_ratio():
    runs = [_run(0, 0.001, 0.004, 0.002), _run(1, 0.003, 0.005, None), _run(2, 0.001, 0.010, 0.004)]
    (row,) = peers_pkg.seed_summary(runs)
    assert row["best_slice_peer"] == ["verl_pkg", "hf_rebalance", "verl_pkg"]  # a failed peer is not the best
    assert row["ratios"] == pytest.approx([0.5, 0.6, 0.25])
    assert row["mean"] == pytest.approx(0.45)
    assert row["worst"] == pytest.approx(0.6)
    assert row["goal_met"] is False  # the worst seed is over 50%
    assert "ratio worst" in peers_pkg.seeds_markdown([row])


def test_seed_summary_has_no_worst_when_a_seed_has_no_ratio():
    runs = [_run(0, 0.001, 0.004, 0.002), _run(1, 0.001, 0.004, 0.002)]
    runs[1]["slices_ratio"] = None
    (row,) = peers_pkg.seed_summary(runs)
    assert row["worst"] is None and row["goal_met"] is False


@pytest.mark.slow
def test_compare_seeds_runs_every_slice_peer_on_every_seed(tmp_path):
    pytest.importorskip("verl")
    import compare

    assert compare.main(["--suite", "peers2026", "--seeds", "0,1", "--tokens", "1e6", "--dists", "sft",
                         "--name", str(tmp_path / "run")]) == 0  # fmt: skip
    data = json.loads((tmp_path / "run_seeds.json").read_text())
    assert data["config"]["seeds"] == [0, 1]
    assert len(data["runs"]) == 2 * len(compare.TOPOLOGIES_2026)
    for run in data["runs"]:
        assert set(run["peers"]) == {"balancer", "hf_rebalance", "verl_pkg", "balancer_slices"}
        assert run["peers"]["balancer_slices"]["status"] == "ok"
    assert [r["seeds"] for r in data["rows"]] == [[0, 1]] * len(compare.TOPOLOGIES_2026)
