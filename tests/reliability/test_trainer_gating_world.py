"""The gradient-accumulation-1 gating in a real run: `BalancedTrainer` on two gloo processes (torchrun's environment),
a tiny Llama from its config, default `TrainingArguments` (gradient accumulation 1: every micro-batch runs DDP's
all-reduce and waits for the slowest rank) and the default topology. The logs hold the plan's
`balance/predicted_imbalance` and no measured figure, and each process warns once, naming the setting (old: it
logged `balance/measured_imbalance` ~1.0 computed from wait-included times). The same world with gradient
accumulation 2 logs the measured figures and does not warn: the gating is what removes them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from support.trainer import run_torchrun_world, tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow  # two Trainer processes on gloo

ROWS = token_rows(96, seed=11, max_len=48)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(rank: int, world: int, out_dir: str) -> None:
    import balancer.hf

    ds = datasets.Dataset.from_dict({"input_ids": ROWS})
    record = {}
    for accumulation, mode in ((1, "shadow"), (1, "adapt"), (2, "shadow")):
        lines = _Lines()
        logger = logging.getLogger("balancer.trainers.balance")
        logger.addHandler(lines)
        args = training_args(
            Path(out_dir) / f"ga{accumulation}{mode}", max_steps=4, logging_strategy="steps", logging_steps=1,
            gradient_accumulation_steps=accumulation, per_device_train_batch_size=2,
        )  # fmt: skip
        trainer = balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=ds, balance_mode=mode)
        trainer.train()
        logger.removeHandler(lines)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        record[f"{accumulation}-{mode}"] = {"logs": logs, "warnings": lines.lines, "m": trainer.topology.micro_batches}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def test_gradient_accumulation_one_logs_no_measured_figure_on_two_processes(tmp_path):
    from balancer.trainers.balance import MEASURED

    run_torchrun_world(2, _run, str(tmp_path))
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for mode in ("shadow", "adapt"):
            run = record[f"1-{mode}"]
            assert run["m"] == 1 and len(run["logs"]) == 4
            # the plan's figure from the first closed step on (the monitor closes a step at a later gather)
            assert [e["step"] for e in run["logs"] if "balance/predicted_imbalance" in e] == [3, 4], run["logs"]
            for entry in run["logs"]:
                assert not [k for k in entry if k.startswith("balance/") and k[len("balance/") :] in MEASURED], entry
                assert not [k for k in entry if k.startswith("balance/rank_speed_")], entry
            named = [w for w in run["warnings"] if "gradient_accumulation_steps=1" in w]
            assert len(named) == 1, run["warnings"]  # once per process
            assert "on 2 processes" in named[0] and ("cannot adapt" in named[0]) == (mode == "adapt")
        control = record["2-shadow"]
        assert control["m"] == 2
        measured = [
            e["step"] for e in control["logs"] if "balance/measured_imbalance" in e and "balance/idle_fraction" in e
        ]
        assert measured == [3, 4], control["logs"]
        assert not [w for w in control["warnings"] if "gradient_accumulation_steps" in w]
