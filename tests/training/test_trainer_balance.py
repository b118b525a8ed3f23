"""BalancedTrainer(balance_mode=...): the monitor times every micro-batch and logs its report under `balance/`
without changing training (shadow's weights equal off's bit for bit), a checkpoint carries the monitor's state
and a resumed run restores it, and a bad mode is refused."""

from __future__ import annotations

import json

import pytest
import torch
from support.trainer import tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow  # transformers Trainer runs

import balancer  # noqa: E402

ROWS = token_rows(80, seed=3, max_len=60)
TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=160, tokens_per_step=300)


def _trainer(out, mode, **overrides):
    import balancer.hf

    ds = datasets.Dataset.from_dict({"input_ids": ROWS})
    args = training_args(out, logging_strategy="steps", logging_steps=2, **overrides)
    kw = {} if mode == "default" else {"balance_mode": mode}
    return balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=ds, topology=TOPO, **kw)


def test_shadow_logs_the_report_and_changes_nothing(tmp_path):
    off = _trainer(tmp_path / "off", "off")
    off.train()
    assert off.balance_monitor is None
    shadow = _trainer(tmp_path / "shadow", "default")
    shadow.train()
    assert shadow.balance_mode == "shadow"
    for (n, a), (_, b) in zip(off.model.named_parameters(), shadow.model.named_parameters()):
        assert torch.equal(a, b), n
    mon = shadow.balance_monitor
    assert len(mon.ledger.steps) == shadow.state.global_step > 4
    logged = [h for h in shadow.state.log_history if "balance/measured_imbalance" in h]
    assert logged and all(h["balance/measured_imbalance"] == 1.0 for h in logged)  # one replica
    assert "balance/prediction_error_median" in logged[-1] and "balance/mean_step_seconds" in logged[-1]
    assert mon.report()["mean_step_seconds"] > 0


def test_checkpoint_carries_the_monitor(tmp_path):
    first = _trainer(tmp_path / "run", "adapt", save_strategy="steps", save_steps=4, max_steps=4)
    first.train()
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "balancer_sampler.json").read_text())
    assert state["monitor"]["mode"] == "adapt" and len(state["monitor"]["ledger"]["steps"]) == 4
    resumed = _trainer(tmp_path / "run", "adapt", save_strategy="no", max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert [s["step"] for s in resumed.balance_monitor.ledger.steps] == [0, 1, 2, 3, 4, 5]


def test_bad_mode():
    with pytest.raises(ValueError, match="balance_mode must be one of"):
        _trainer("unused", "always")
