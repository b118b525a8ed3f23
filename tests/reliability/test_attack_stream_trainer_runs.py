"""A second and a third `trainer.train()` of one BalancedTrainer on a stream in adapt mode (the stream path of the
sampler path's tests/reliability/test_second_train.py). `train()` closes the stream when it returns (a stream trains
once, documented). Old: the second run went through the Trainer's whole set-up (and the monitor's restart) and then
failed inside the data loader's first iter() with "the BalancedStream is closed: build a new one", which names
neither train() nor how to go on. New: refused up front, naming both; the model is not touched."""

from __future__ import annotations

import json

import pytest
import torch
from support.trainer import tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow  # transformers Trainer runs

import balancer  # noqa: E402

ROWS = token_rows(60, seed=4, max_len=60)
TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=160, tokens_per_step=300)


def test_three_train_runs_on_a_stream_in_adapt_mode(tmp_path):
    import balancer.hf
    from balancer.streaming import BalancedStream

    path = tmp_path / "part-0.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ROWS))
    source = datasets.load_dataset("json", data_files=[str(path)], split="train", streaming=True)
    cost = balancer.CostModel.from_config(tiny_llama().config.to_dict())
    stream = BalancedStream(source, TOPO, cost, window_docs=20, seed=0)
    args = training_args(tmp_path / "run", logging_strategy="steps", logging_steps=2, max_steps=6)
    trainer = balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=stream, balance_mode="adapt")
    trainer.train()
    assert [s["step"] for s in trainer.balance_monitor.ledger.steps] == list(range(6))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for _ in range(2):  # a second and a third run
        with pytest.raises(RuntimeError, match=r"train\(\) on a BalancedStream runs once.*resume_from_checkpoint"):
            trainer.train()
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert len(trainer.balance_monitor.ledger.steps) == 6
