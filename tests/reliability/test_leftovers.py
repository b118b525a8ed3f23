"""The four leftovers of the last reliability round: each was accepted or misreported by the old code."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.reliability import cli

import balancer
from balancer.data.pretokenize.tokenize import TokenizerError, load_tokenizer
from balancer.measured import BalanceMonitor


@pytest.fixture()
def lengths_file(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(np.random.default_rng(0).integers(1, 3000, 500).tolist()))
    return path


def test_plan_refuses_epoch_without_windows(lengths_file, tmp_path, capsys):
    # old: exit 0 and the epoch-0 plan (the flag silently ignored)
    code, lines = cli(capsys, "plan", lengths_file, "--dp", "2", "--epoch", "5", "-o", tmp_path / "p.json")
    assert code == 2 and len(lines) == 1 and "--epoch 5" in lines[0] and "--window-docs" in lines[0], lines
    assert not (tmp_path / "p.json").exists()


def test_plan_epoch_with_windows_still_plans_that_epoch(lengths_file, tmp_path, capsys):
    argv = ["plan", lengths_file, "--dp", "2", "--window-docs", "100", "--window-index", "1"]
    assert cli(capsys, *argv, "--epoch", "5", "-o", tmp_path / "a.json")[0] == 0
    assert cli(capsys, *argv, "-o", tmp_path / "b.json")[0] == 0
    a, b = (balancer.Plan.load(tmp_path / n) for n in ("a.json", "b.json"))
    assert not np.array_equal(a.doc, b.doc)  # another epoch, another shuffle


@pytest.mark.parametrize("spec", ["{tmp}/missing_tokenizer", "./no/such/tokenizer", "{tmp}/file.txt"])
def test_missing_tokenizer_folder_is_named(tmp_path, spec):
    (tmp_path / "file.txt").write_text("x")
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(TokenizerError) as err:  # old: transformers' "Repo id must use alphanumeric chars ..."
        load_tokenizer(spec)
    text = str(err.value)
    assert "tokenizer folder" in text and spec.lstrip("./").split("/")[-1] in text and "Repo id" not in text


def _monitor():
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)
    lengths = np.random.default_rng(0).integers(100, 2000, 200)
    sampler = balancer.BalancedBatchSampler(
        lengths, topo, balancer.CostModel(attn_coef=0.0, linear_coef=1.0), dp_rank=0, seed=0
    )
    return BalanceMonitor(sampler, mode="shadow")


@pytest.mark.parametrize("seconds", ["0.5", True, False, b"1", None, [0.5], float("nan"), float("inf"), -1.0])
def test_record_refuses_what_is_not_a_time(seconds):
    mon = _monitor()
    with pytest.raises(ValueError, match="seconds"):  # old: "0.5" and True were accepted as 0.5 s and 1 s
        mon.record(seconds)


@pytest.mark.parametrize(("name", "value"), [("step", "1"), ("step", True), ("micro_batch", 0.5), ("micro_batch", -1)])
def test_record_refuses_positions_that_are_not_integers(name, value):
    mon = _monitor()
    with pytest.raises(ValueError, match=name):
        mon.record(0.1, **{name: value})


def test_record_takes_numpy_and_int_times():
    mon = _monitor()
    mon.record(np.float32(0.25))
    mon.record(1, micro_batch=np.int64(1))


@pytest.mark.parametrize(
    "options",
    [
        {"timeout": True},  # old: accepted as 1 s
        {"timeout": float("inf")},  # old: accepted, then an OverflowError at the first gather
        {"min_samples": 0},
        {"min_samples": -3},
        {"min_samples": "5"},
        {"min_samples": 2.5},
        {"min_samples": True},
        {"layout": "bogus"},
        {"cuda": "no"},
    ],
)
def test_monitor_refuses_bad_options_naming_them(options):
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)
    lengths = np.random.default_rng(0).integers(100, 2000, 200)
    cost = balancer.CostModel(attn_coef=0.0, linear_coef=1.0)
    sampler = balancer.BalancedBatchSampler(lengths, topo, cost, dp_rank=0, seed=0)
    with pytest.raises(ValueError, match=next(iter(options))):
        BalanceMonitor(sampler, **options)
    assert sampler.monitor is None  # nothing attached by a refused monitor
