"""The balanced trainers write their checkpoint's sampler / stream state through `balancer.files.atomic_write`: a
symbolic link at the state's path is refused, naming it, and neither the link nor its target is touched."""

from __future__ import annotations

import os

import pytest
from support.trainer import tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # transformers Trainer runs

ROWS = token_rows(12, seed=4)


def _topology():
    import balancer

    total = sum(len(r) for r in ROWS)
    return balancer.Topology(dp=1, cp=1, micro_batches=2, max_tokens=total, tokens_per_step=-(-total // 2))


def _sampler_trainer(out):
    import balancer.hf

    args = training_args(out, max_steps=1, save_strategy="steps", save_steps=1)
    rows = datasets.Dataset.from_dict({"input_ids": ROWS})
    return balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=rows, topology=_topology())


def _stream_trainer(out):
    import balancer
    import balancer.hf
    from balancer.streaming import BalancedStream

    cost = balancer.CostModel.from_config(tiny_llama().config.to_dict())
    source = datasets.Dataset.from_dict({"input_ids": ROWS}).to_iterable_dataset()
    stream = BalancedStream(source, _topology(), cost, window_docs=len(ROWS), seed=0)
    args = training_args(out, max_steps=1, save_strategy="steps", save_steps=1)
    return balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=stream)


CASES = {"sampler": (_sampler_trainer, "balancer_sampler.json"), "stream": (_stream_trainer, "balancer_stream.json")}


@pytest.mark.parametrize("case", list(CASES))
def test_a_state_path_that_is_a_symlink_is_refused(tmp_path, case):
    from balancer.files import OutputPathError

    build, name = CASES[case]
    target = tmp_path / "elsewhere.json"
    target.write_text("keep")
    folder = tmp_path / "out" / "checkpoint-1"
    folder.mkdir(parents=True)
    link = folder / name
    os.symlink(target, link)
    trainer = build(tmp_path / "out")
    with pytest.raises(OutputPathError, match="symbolic link") as err:
        trainer.train()
    assert str(link) in str(err.value)
    assert os.path.islink(link) and target.read_text() == "keep"
    assert not [p for p in os.listdir(folder) if p != name]  # no temporary left behind


@pytest.mark.parametrize("case", list(CASES))
def test_the_state_is_written_as_json(tmp_path, case):
    import json

    build, name = CASES[case]
    trainer = build(tmp_path / "out")
    trainer.train()
    path = tmp_path / "out" / "checkpoint-1" / name
    assert not path.is_symlink()
    assert isinstance(json.loads(path.read_text()), dict)
