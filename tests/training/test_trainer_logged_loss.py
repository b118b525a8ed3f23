"""balancer.hf.BalancedTrainer logs the true loss: with learning rate 0 (the weights never move, so the exact figure
is known) every logged `loss` and the final `train_loss` equal the mean token loss of the steps they cover, computed
by a plain forward pass over each step's documents one at a time (not from the trainer's figures), on 1, 2 and 4
processes, with and without CP. The epoch has an odd number of steps and `logging_steps=2`, so the last step is
never logged and reaches `train_loss` only through the end-of-training path (the one the stock loop takes from
rank 0 alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.trainer import run_torchrun_world, tiny_llama, token_rows, training_args  # noqa: E402

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # transformers Trainer on gloo

TOL = 1e-4  # relative; measured 1.6e-8 (logged) and 1.1e-8 (train_loss) on one process; the issue asks for 1%
ROWS = token_rows(30, seed=5, max_len=48)
# name: (dp, cp); every configuration plans the same epoch size: 3 steps of 2 micro-batches
WORLDS = {1: {"dp1": (1, 1)}, 2: {"dp2": (2, 1), "cp2": (1, 2)}, 4: {"dp4": (4, 1), "dp2xcp2": (2, 2)}}


def _topology(dp: int, cp: int):
    import balancer

    total = sum(len(r) for r in ROWS)
    return balancer.Topology(
        dp=dp, cp=cp, micro_batches=2, max_tokens=-(-total // (2 * dp * cp)), tokens_per_step=total // 3 + 1
    )


def _run(rank, world, out_dir):
    import balancer.hf

    for name, (dp, cp) in WORLDS[world].items():
        out = Path(out_dir) / name
        args = training_args(out, learning_rate=0.0, logging_strategy="steps", logging_steps=2)
        ds = datasets.Dataset.from_dict({"input_ids": ROWS})
        trainer = balancer.hf.BalancedTrainer(
            model=tiny_llama(), args=args, train_dataset=ds, topology=_topology(dp, cp)
        )
        sampler = trainer.balanced_sampler
        steps = [
            [int(i) for r in range(dp) for m in range(2) for i in sampler.micro_batch(s, m, dp_rank=r)]
            for s in range(sampler.num_steps)
        ]
        result = trainer.train()
        if rank == 0:
            logs = [e["loss"] for e in trainer.state.log_history if "loss" in e]
            record = {"steps": steps, "logged": logs, "train_loss": result.training_loss}
            (Path(out_dir) / f"{name}.json").write_text(json.dumps(record))


def _step_loss(model, docs) -> float:
    """The exact mean token loss of one step: every document alone, unpacked, plain forward."""
    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            ids = torch.tensor(ROWS[d])
            if len(ids) < 2:
                continue
            logits = model(input_ids=ids[None]).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
            count += len(ids) - 1
    return total / count


def _check(out_dir: Path, name: str) -> None:
    record = json.loads((out_dir / f"{name}.json").read_text())
    steps = record["steps"]
    assert len(steps) == 3, len(steps)  # odd: the last step is left for train_loss alone
    assert sorted(d for s in steps for d in s) == list(range(len(ROWS)))  # every document once
    model = tiny_llama("eager")
    exact = [_step_loss(model, s) for s in steps]
    want_logs = [(exact[0] + exact[1]) / 2]  # logging_steps=2: the mean of the two steps' means
    assert len(record["logged"]) == 1
    for got, want in zip(record["logged"], want_logs):
        assert abs(got - want) <= TOL * want, (name, got, want)
    want = sum(exact) / len(exact)
    assert abs(record["train_loss"] - want) <= TOL * want, (name, record["train_loss"], want)


def test_logged_loss_single_process(tmp_path):
    _run(0, 1, str(tmp_path))
    _check(tmp_path, "dp1")


@pytest.mark.parametrize("world", [2, 4])
def test_logged_loss_on_several_ranks_with_and_without_cp(tmp_path, world):
    run_torchrun_world(world, _run, str(tmp_path))
    for name in WORLDS[world]:
        _check(tmp_path, name)
