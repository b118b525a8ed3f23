"""A second `trainer.train()` on the same BalancedTrainer with the default (shadow) monitor. Old: the monitor's step
counter went on from the first run's last step while the sampler started a new pass, and the first `end_step` of the
second run raised IndexError ("step 8 out of range: this plan has 8 steps"). New: each train() starts the monitor's
steps from the start of a pass again (the steps closed before gathered first), the ledger keeps both runs."""

from __future__ import annotations

import pytest
from support.trainer import tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow  # transformers Trainer runs

import balancer  # noqa: E402

ROWS = token_rows(60, seed=3, max_len=60)
TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=160, tokens_per_step=300)


def test_second_train_counts_its_steps_from_the_start_of_a_pass(tmp_path):
    import balancer.hf

    ds = datasets.Dataset.from_dict({"input_ids": ROWS})
    args = training_args(tmp_path / "run", logging_strategy="steps", logging_steps=2)
    trainer = balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=ds, topology=TOPO)
    trainer.train()
    mon = trainer.balance_monitor
    first = [(s["epoch"], s["step"]) for s in mon.ledger.steps]
    steps = trainer.state.global_step
    assert first == [(0, k) for k in range(steps)] and steps > 2
    trainer.train()  # old: IndexError from monitor.end_step
    assert trainer.balance_monitor is mon and trainer.state.global_step == steps
    assert [(s["epoch"], s["step"]) for s in mon.ledger.steps] == first + first
    report = mon.report()
    assert report["mean_step_seconds"] > 0
    logged = [h for h in trainer.state.log_history if "balance/measured_imbalance" in h]
    assert logged and logged[-1]["balance/measured_imbalance"] == 1.0  # one replica
