"""balancer.hf.BalancedTrainer's FLOPs estimate (`state.total_flos`) is the stock Trainer's formula, 6 x input tokens x
non-embedding parameters, with the parameter count taken once per `train()` (not once per micro-batch), and counted
again by the next `train()`."""

from __future__ import annotations

import pytest
from support.trainer import tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # the transformers Trainer


def _trainer(tmp_path, rows, **kwargs):
    import balancer
    import balancer.hf

    total = sum(len(r) for r in rows)
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=128, tokens_per_step=total // 3)
    model = tiny_llama()
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    args = training_args(tmp_path / "out", num_train_epochs=1)
    return balancer.hf.BalancedTrainer(model=model, args=args, train_dataset=ds, topology=topo, **kwargs)


def test_total_flos_is_the_stock_formula_with_one_parameter_count_per_train(tmp_path):
    rows = token_rows(24, seed=3)
    trainer = _trainer(tmp_path, rows, balance_mode="off")  # the monitor's steps go on across train() calls
    calls = []
    count = trainer.model.num_parameters

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return count(*args, **kwargs)

    trainer.model.num_parameters = counted  # a spy on the real method: the value is the model's own
    trainer.train()
    params = count(exclude_embeddings=True)
    tokens = sum(len(r) for r in rows)
    assert trainer.balanced_sampler.num_steps >= 3
    assert trainer.state.total_flos == 6 * tokens * params  # every token once, each micro-batch's ids counted
    assert calls == [{"exclude_embeddings": True}]  # once for the run, not once per micro-batch
    trainer.train()
    assert len(calls) == 2  # the next train() counts again
