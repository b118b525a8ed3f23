"""No command prints a figure it did not measure as if it had: the balance tables of `plan`, `stats`, `demo` and
`pack` say which figures the cost model predicts (the speedup among them) and which one is a clock reading."""

from __future__ import annotations

import json

import numpy as np
import pytest

from balancer.cli import main
from balancer.cli.data import pack_balance_report
from balancer.cli.report import PREDICTED_NOTE, UNTIMED_NOTE


@pytest.fixture()
def lengths_file(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(np.random.default_rng(0).integers(1, 3000, 2000).tolist()))
    return path


def _labelled(text: str, speedup: bool) -> None:
    assert PREDICTED_NOTE in text
    rows = [line for line in text.splitlines() if "speedup" in line and not line.startswith("(")]
    assert (len(rows) >= 1) == speedup and all(row.startswith("predicted speedup vs ") for row in rows), rows


def test_plan_labels_the_speedup_and_the_metrics_as_predicted(lengths_file, tmp_path, capsys):
    assert main(["plan", str(lengths_file), "--dp", "2", "--micro-batches", "2", "-o", str(tmp_path / "p.json")]) == 0
    _labelled(capsys.readouterr().out, speedup=True)


def test_stats_balance_report_labels_the_speedup_as_predicted(lengths_file, capsys):
    assert main(["stats", str(lengths_file), "--dp", "2", "--micro-batches", "2"]) == 0
    _labelled(capsys.readouterr().out, speedup=True)


def test_pack_report_labels_the_recorded_metrics_as_predicted():
    metrics = {k: 1.0 for k in ("imbalance", "worst_step", "epoch_efficiency", "token_utilization", "plan_seconds")}
    metrics.update(steps=3, padding_tokens=0, dropped_tokens=0, mean_delay_steps=0.0, step_time_total=2.0)
    manifest = {"epochs": [{"epoch": 0, "metrics": metrics}]}
    text = pack_balance_report(manifest)
    # a manifest records no planning time (its bytes repeat): no plan_seconds row under "plan_seconds is measured"
    assert UNTIMED_NOTE in text and PREDICTED_NOTE not in text and "plan_seconds" not in text
    assert all("speedup" not in line for line in text.splitlines())


@pytest.mark.slow
def test_demo_labels_the_speedup_as_predicted(capsys):
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    _labelled(text, speedup=True)
    assert "predicted step time:" in text and "if the cost model holds" in text
