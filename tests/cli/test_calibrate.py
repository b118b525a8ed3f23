"""`balancer calibrate` and its Python API: a real tiny Llama timed on gloo worlds of 1 and 2, fitted, written,
read back by `CostModel.load` and `balancer plan --cost`."""

import json

import numpy as np
import pytest

from balancer import CostModel, Plan
from balancer.calibration import KINDS, calibration_grid, error_summary, leaked_compositions
from balancer.calibration.report import fit_samples
from balancer.cli import main
from balancer.planning.cost.predict import micro_batch_time


def test_grid_fills_budgets_exactly():
    grid = calibration_grid([64, 1000, 4096], per_cell=3, seed=1)
    assert len(grid) == 3 * len(KINDS) * 3
    for kind, lengths in grid:
        assert kind in KINDS and min(lengths) >= 1
    assert [sum(lengths) for _, lengths in grid] == [b for b in (64, 1000, 4096) for _ in range(3 * len(KINDS))]
    long_tail = [max(lengths) / sum(lengths) for kind, lengths in grid if kind == "longtail"]
    sft = [max(lengths) / sum(lengths) for kind, lengths in grid if kind == "sft"]
    assert min(long_tail) >= 0.2 - 1e-9 and np.mean(long_tail) > 2 * np.mean(sft)
    assert calibration_grid([512], seed=3) == calibration_grid([512], seed=3)


def test_error_summary():
    e = error_summary([1.1, 0.95, 2.0], [1.0, 1.0, 1.0])
    assert e["median_abs_error"] == pytest.approx(0.1) and e["max_abs_error"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--split-threshold", "0"], "--split-threshold"),
        (["--repeats", "0"], "--repeats"),
        (["--tokens", "256", "--per-cell", "1", "--cp", "1", "--layout", "zigzag"], "--per-cell"),
        (["--tokens", "8"], "--tokens"),
        (["--layout", "diagonal"], "--layout"),
        (["--model-config", "/nonexistent/config.json"], "--model-config"),
        (["--held-out", "1.5"], "--held-out"),
        (["--splits", "0"], "--splits"),
        (["--fresh", "-1"], "--fresh"),
        (["--loss", "l1"], "--loss"),
        (["--statistic", "mean"], "--statistic"),
    ],
)
def test_calibrate_rejects_bad_options(tmp_path, capsys, argv, match):
    assert main(["calibrate", "-o", str(tmp_path / "c.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.slow  # times a model over gloo: ~50 s
def test_calibrate_cli_writes_a_model_plan_reads(tmp_path, capsys):
    """Budgets of 1K and 4K tokens: the linear and attention work is tens of milliseconds there, well above the
    scheduling noise of a loaded machine (at 256-512 tokens a fit could put everything on the fixed and per-piece
    terms)."""
    out = tmp_path / "cost.json"
    argv = ["calibrate", "--tokens", "1024", "4096", "--per-cell", "2", "--repeats", "1", "--max-repeats", "1"]
    argv += ["--cp", "1", "2"]
    argv += ["--layout", "hybrid", "--fresh", "1", "--splits", "3"]
    assert main([*argv, "--held-out", "0.25", "-o", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "held_out" in captured.out and "median |error|" in captured.out
    assert "fresh micro-batches timed after the fit: 4, median |error|" in captured.out
    cost = CostModel.load(out)
    assert cost.attn_coef > 0 and cost.linear_coef > 0
    data = json.loads(out.read_text())
    report = data["report"]
    samples = report["samples"]
    assert report["held_out"]["count"] >= 1 and report["train"]["count"] >= 7 and report["fresh"]["count"] == 4
    assert {(s["cp"], s["layout"]) for s in samples} == {(1, "zigzag"), (2, "hybrid")}
    # the split is by micro-batch: no held-out documents were timed in the fit, at any CP size or layout
    assert not leaked_compositions(samples)
    assert report["split"]["by"] == "micro-batch" and report["splits"]["count"] == 3
    # the written model is the fit of the fit set alone: refitting those samples gives it back
    fitted = [s for s in samples if not s["held_out"] and not s["fresh"]]
    assert report["loss"] == "trim" and fit_samples(fitted, None, "ring", {}, report["loss"]) == cost
    clock = report["clock"]
    assert clock in ("wall", "cpu") and report["clock_reason"].startswith(("wall time", "process CPU time"))
    assert all(s["seconds"] > 0 and min(s[clock]) == s["seconds"] for s in samples)
    for s in samples:  # the report's predictions are the written model's
        assert s["predicted"] == pytest.approx(micro_batch_time(cost, s["lengths"], s["cp"], s["layout"]), rel=1e-12)
    assert len(report["machine"]["loadavg_before"]) == 3 and report["machine"]["cores"] >= 1
    assert report["meets_targets"] == (not report["warnings"])
    assert ("warning: the fit misses its targets" in captured.err) == (not report["meets_targets"])
    assert all("Remedy: raise --max-repeats" in w for w in report["warnings"])
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps(np.random.default_rng(0).integers(1, 500, 200).tolist()))
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(lengths), "--dp", "2", "--cost", str(out), "-o", str(plan_path), "--no-baseline"]) == 0
    assert Plan.load(plan_path).cost_model == cost


@pytest.mark.slow  # times a small grid over gloo: ~15-50 s
def test_calibrate_prints_progress_lines_without_a_terminal(tmp_path):
    """With stderr a pipe (a log, a batch job) calibrate prints a progress line at each quarter of its timings
    (before, the bar showed only on a terminal and a log stayed silent for the whole run)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    argv = ["calibrate", "--tokens", "512", "1024", "--per-cell", "2", "--repeats", "1", "--max-repeats", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "balancer", *argv, "--cp", "1", "-o", str(tmp_path / "cost.json")],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("calibrate: timed ")]
    assert len(lines) >= 4 and "(100%)" in lines[-1], out.stderr
    assert "(25%)" in lines[0] or "(50%)" in lines[0]
