"""BalancedTrainer on fixed-length rows whose count does not fill every step: the last step runs M' < micro_batches
micro-batches on every replica, the optimizer still steps after them and the loss over that step is normalised by
its own loss tokens - the weights equal a plain loop of SGD steps (lr 1) over the same steps' rows, one document at
a time, single process and on 2 gloo processes (dp2, through the stock Trainer, accelerate and DDP)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.trainer import relative_error, run_torchrun_world, tiny_llama, training_args, unpacked_sgd_delta

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # transformers Trainer, gloo worlds

TOL = 3e-4  # fp32, as tests/training/test_trainer.py
ROW = 16  # tokens per row; max_tokens = ROW: one row per micro-batch


def _rows(n: int) -> list[list[int]]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, 64, ROW).tolist() for _ in range(n)]


def _train(rank, world, rows, dp, out_path, filler_rows=False):
    """Train one epoch; rank 0 saves the weight change and every step's documents (all replicas; filler rows
    left out)."""
    import balancer
    import balancer.hf
    from balancer.training import Filler

    topo = balancer.Topology(dp=dp, micro_batches=2, max_tokens=ROW)
    model = tiny_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    trainer = balancer.hf.BalancedTrainer(
        model=model, args=training_args(Path(out_path).with_suffix("")), train_dataset=ds, topology=topo,
        filler_rows=filler_rows,
    )  # fmt: skip
    sampler = trainer.balanced_sampler
    steps = sampler.num_steps
    assert sampler.step_micro_batches(steps - 1) == 1 and len(sampler) == 2 * (steps - 1) + 1
    trainer.train()
    assert trainer.state.global_step == steps  # the optimizer stepped after the short last step too
    if rank == 0:
        every = [
            [d for r in range(dp) for m in range(sampler.step_micro_batches(s)) for d in sampler.micro_batch(s, m, r)]
            for s in range(steps)
        ]
        assert sum(isinstance(d, Filler) for step in every for d in step) == (1 if filler_rows else 0)
        docs = [[d for d in step if not isinstance(d, Filler)] for step in every]
        delta = {n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}
        torch.save({"delta": delta, "docs": docs}, out_path)


def _plain_loop(rows, docs) -> dict:
    """SGD (lr 1) step after step, each on the mean token loss of its documents; the weight change."""
    model = tiny_llama("eager")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step_docs in docs:
        model.zero_grad()
        delta = unpacked_sgd_delta(model, [rows[d] for d in step_docs])
        with torch.no_grad():
            for n, p in model.named_parameters():
                p += delta[n]
    return {n: p.detach() - start[n] for n, p in model.named_parameters()}


def _check(rows, saved, dp: int, fillers: int = 0) -> None:
    docs = saved["docs"]
    assert sorted(d for step in docs for d in step) == list(range(len(rows)))  # every row exactly once
    # the last step: M' = 1 micro-batch per replica (its filler rows are not documents)
    assert [len(s) for s in docs] == [2 * dp] * (len(docs) - 1) + [dp - fillers]
    err = relative_error(saved["delta"], _plain_loop(rows, docs))
    assert err <= TOL, err


def test_short_last_step_equals_plain_loop_single_process(tmp_path):
    rows = _rows(5)  # dp 1 x 2 micro-batches: steps of 2, 2 and a last one of 1
    _train(0, 1, rows, 1, tmp_path / "out.pt")
    _check(rows, torch.load(tmp_path / "out.pt"), 1)


def test_short_last_step_equals_plain_loop_two_processes(tmp_path):
    rows = _rows(10)  # dp 2 x 2 micro-batches: steps of 4, 4 and a last one of 2 (1 micro-batch per replica)
    run_torchrun_world(2, _train, rows, 2, str(tmp_path / "out.pt"))
    _check(rows, torch.load(tmp_path / "out.pt"), 2)


def test_filler_rows_train_nothing_two_processes(tmp_path):
    """9 rows on dp 2 x 2: 2 full steps and one row left, which cannot give both replicas a micro-batch; with
    filler_rows one loss-masked filler row is added and the weights still equal the plain loop over the real rows."""
    rows = _rows(9)
    run_torchrun_world(2, _train, rows, 2, str(tmp_path / "out.pt"), True)
    _check(rows, torch.load(tmp_path / "out.pt"), 2, fillers=1)
