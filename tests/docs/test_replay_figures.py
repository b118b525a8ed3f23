"""benchmarks/replay.py's paired repetitions: a plan's speedup is the median of the per-repetition ratios with their
spread, each pair of plans is called faster only where it was faster in every repetition (else within noise), and
README.md's replay paragraph says on each clock what holds, from the record."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("replay"), importlib.import_module("readme_figures")


def row(wall: list[float], cpu: list[float], predicted: float) -> dict:
    return {
        "epoch_wall_seconds": float(np.median(wall)),
        "epoch_cpu_seconds": float(np.median(cpu)),
        "reps_epoch_wall_seconds": wall,
        "reps_epoch_cpu_seconds": cpu,
        "epoch_seconds": float(np.median(cpu)),
        "compute_seconds": float(np.median(cpu)),
        "predicted_compute_seconds": predicted,
        "wall_over_cpu": float(np.median(wall) / np.median(cpu)),
    }


def test_paired_ratios_and_verdicts(modules):
    replay, _ = modules
    rows = {
        "a": row([10.0, 12.0, 9.0], [5.0, 5.0, 5.0], 9.0),
        "b": row([11.0, 11.0, 10.0], [6.0, 5.5, 6.5], 10.0),
    }
    wall, cpu = replay.paired(rows, "a", "b", "wall"), replay.paired(rows, "a", "b", "cpu")
    assert wall["verdict"] == "within noise" and wall["reps"] == 3  # a faster in 2 repetitions, slower in 1
    assert np.isclose(wall["median"], 11 / 10) and np.isclose(wall["min"], 11 / 12) and np.isclose(wall["max"], 10 / 9)
    assert cpu["verdict"] == "a faster" and np.isclose(cpu["median"], 1.2) and np.isclose(cpu["min"], 1.1)
    assert replay.paired(rows, "b", "a", "cpu")["verdict"] == "a faster"


def test_compare_takes_the_median_of_paired_ratios_not_the_ratio_of_medians(modules):
    replay, _ = modules
    rows = {"a": row([1.0, 4.0, 4.0], [1.0, 1.0, 1.0], 1.0), "base": row([2.0, 2.0, 5.0], [2.0, 2.0, 2.0], 2.0)}
    out = replay.compare(rows, "base")
    a = out["rows"]["a"]
    assert np.isclose(a["measured_speedup_wall"], 1.25) and a["measured_speedup_wall_spread"] == [0.5, 2.0]
    assert np.isclose(a["measured_speedup_cpu"], 2.0) and out["pairs"]["a vs base"]["wall"]["verdict"] == "within noise"
    assert out["ranking_measured_cpu"] == ["a", "base"] and out["ranking_correct"]


def test_the_readme_paragraph_states_what_holds_on_each_clock(modules, monkeypatch):
    replay, figures = modules
    record = copy.deepcopy(figures.load("replay"))
    dp2 = {
        "balancer": row([30.0, 33.0, 36.0], [10.0, 10.0, 10.0], 8.0),
        "trl-bfd": row([33.0, 30.0, 39.0], [12.0, 13.0, 12.5], 10.0),
        "token-count": row([28.0, 29.0, 30.0], [10.5, 9.5, 10.2], 9.0),
    }
    layout = {"balancer+zigzag": row([20.0] * 3, [8.0] * 3, 8.0), "balancer+hybrid": row([16.0] * 3, [6.4] * 3, 6.8)}
    record["runs"]["dp2"] = {**replay.compare(dp2, "trl-bfd"), "reps": 3}
    record["runs"]["layout"] = {**replay.compare(layout, "balancer+zigzag"), "reps": 3}
    monkeypatch.setattr(figures, "load", lambda n: record if n == "replay" else figures.load(n))
    text = figures.figure_replay()
    assert "3 paired repetitions" in text
    assert "epoch was 1.25x (1.20-1.30x, faster in all 3 repetitions) faster than with TRL's" in text  # CPU
    assert "by wall clock 1.08x (0.91-1.10x, within noise: each faster in some repetition)" in text
    assert "this planner against token-count packing: 1.02x (0.95-1.05x, within noise" in text
    assert "1.25x (1.25-1.25x, faster in all 3 repetitions) faster than zigzag" in text


def test_the_docs_summary_states_each_pair_as_the_record_has_it(modules):
    replay, _ = modules
    data = replay.tb.load("replay")
    text = replay.table_replay_summary()
    for run, a, b in (("dp2", "balancer", "trl-bfd"), ("dp2", "balancer", "token-count")):
        pair = replay.tb.paired_ratio(data["runs"][run], a, b)
        for clock, label in (("cpu", "by CPU time"), ("wall", "by wall clock")):
            p = pair[clock]
            holds = "within noise" if p["verdict"] == "within noise" else f"{p['verdict']} in all {p['reps']}"
            assert f"{label} {p['median']:.3f}x ({p['min']:.3f}-{p['max']:.3f}x; {holds}" in text, (a, b, clock)
    assert f"commit {data['git']['commit'][:10]}." in text
