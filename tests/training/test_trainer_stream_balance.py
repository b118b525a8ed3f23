"""BalancedTrainer(train_dataset=<BalancedStream>, balance_mode=...): the monitor on the stream (StreamSteps) times
every micro-batch and logs under `balance/` (shadow, the default, over two passes), changes no weight against
balance_mode="off", and a checkpoint's `balancer_stream.json` carries the monitor's state, which a resumed run
(adapt) restores and continues (tiny Llama, one process, a local JSONL `datasets` streaming source)."""

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


def _trainer(tmp_path, out, mode, **overrides):
    import balancer.hf
    from balancer.streaming import BalancedStream

    paths = []
    for i, part in enumerate((ROWS[:30], ROWS[30:])):
        path = tmp_path / f"part-{i}.jsonl"
        path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in part))
        paths.append(str(path))
    source = datasets.load_dataset("json", data_files=paths, split="train", streaming=True)
    cost = balancer.CostModel.from_config(tiny_llama().config.to_dict())
    stream = BalancedStream(source, TOPO, cost, window_docs=20, seed=0)
    args = training_args(tmp_path / out, logging_strategy="steps", logging_steps=2, **overrides)
    kw = {} if mode == "default" else {"balance_mode": mode}
    return balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=stream, **kw)


def test_shadow_on_a_stream_logs_the_report_and_changes_nothing(tmp_path):
    shadow = _trainer(tmp_path, "shadow", "default", max_steps=14)
    shadow.train()
    assert shadow.balance_mode == "shadow" and shadow.balanced_stream.epoch == 1  # two passes of the stream
    mon = shadow.balance_monitor
    assert [(s["epoch"], s["window"]) for s in mon.ledger.steps][-1][0] == 1
    assert len(mon.ledger.steps) == shadow.state.global_step == 14
    logged = [h for h in shadow.state.log_history if "balance/measured_imbalance" in h]
    assert logged and all(h["balance/measured_imbalance"] == 1.0 for h in logged)  # one replica
    assert "balance/prediction_error_median" in logged[-1] and mon.report()["mean_step_seconds"] > 0
    off = _trainer(tmp_path, "off", "off", max_steps=14)
    off.train()
    assert off.balance_monitor is None
    for (n, a), (_, b) in zip(off.model.named_parameters(), shadow.model.named_parameters()):
        assert torch.equal(a, b), n


def test_stream_checkpoint_carries_the_monitor(tmp_path):
    first = _trainer(tmp_path, "run", "adapt", save_strategy="steps", save_steps=4, max_steps=4)
    first.train()
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "balancer_stream.json").read_text())
    assert state["monitor"]["mode"] == "adapt" and len(state["monitor"]["ledger"]["steps"]) == 4
    assert state["step"] * TOPO.micro_batches + state["position"] == 8  # the monitor counts steps from here
    resumed = _trainer(tmp_path, "run", "adapt", save_strategy="no", max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert [s["step"] for s in resumed.balance_monitor.ledger.steps] == [0, 1, 2, 3, 4, 5]
