"""BalancedTrainer epochs and resume: every epoch runs its own plan's number of steps (plans of different seeds can
differ by a step), and a run stopped mid-epoch and resumed from its Trainer checkpoint sees exactly the data order of
an uninterrupted run and ends with the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from support.trainer import tiny_llama, token_rows, training_args  # noqa: E402

pytestmark = pytest.mark.slow  # transformers Trainer runs

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

ROWS = token_rows(18, seed=5)
STOP = 6  # checkpoint and stop 2 steps into epoch 1


def _seed_with_epochs_of_4_and_5_steps() -> int:
    """The first plan seed whose epoch 0 has 4 steps and epoch 1 (seed + 1) 5: the case the stock Trainer gets
    wrong. Chosen from the planner itself (epoch e of one window is `balancer.plan(..., seed=SEED + e)`), so a
    planner change that moves step counts does not silently turn this into a test of equal epochs."""
    import balancer

    lengths = [len(r) for r in ROWS]
    topo = balancer.Topology(dp=1, cp=1, micro_batches=2, max_tokens=48)
    cost = balancer.CostModel.from_config(tiny_llama().config.to_dict())
    steps = [balancer.plan(lengths, topo, cost, seed=s).num_steps for s in range(101)]
    return next(s for s in range(100) if steps[s : s + 2] == [4, 5])


SEED = _seed_with_epochs_of_4_and_5_steps()


def _trainer(out_dir, callbacks=(), micro_batches=2, **args):
    import balancer
    import balancer.hf

    class Recording(balancer.hf.BalancedTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            self.order.append(inputs["input_ids"][0].tolist())
            return super().compute_loss(model, inputs, **kwargs)

    topo = balancer.Topology(dp=1, cp=1, micro_batches=micro_batches, max_tokens=48)
    kw = dict(learning_rate=0.05, lr_scheduler_type="linear", num_train_epochs=2)
    kw.update(args)
    trainer = Recording(
        model=tiny_llama(),
        args=training_args(out_dir, **kw),
        train_dataset=datasets.Dataset.from_dict({"input_ids": ROWS}),
        topology=topo,
        seed=SEED,
        callbacks=list(callbacks),
    )
    trainer.order = []
    return trainer


class _StopAt(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == STOP:
            control.should_training_stop = True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 2-epoch run, and a run stopped (with a checkpoint) STOP steps in."""
    tmp = tmp_path_factory.mktemp("runs")
    full = _trainer(tmp / "full")
    full.train()
    first = _trainer(tmp / "run", callbacks=[_StopAt()], save_strategy="steps", save_steps=STOP)
    first.train()
    return full, first, tmp / "run" / f"checkpoint-{STOP}"


def test_epoch_lengths_and_exact_resume(runs):
    full, first, ckpt = runs
    steps = [full._epoch_num_steps(e) for e in (0, 1)]
    assert steps == [4, 5]  # the case the stock Trainer gets wrong (it assumes epoch 0's length for every epoch)
    assert full.state.global_step == sum(steps)
    n_tokens = sum(len(r) for r in ROWS)
    per_epoch = [full.order[: 2 * steps[0]], full.order[2 * steps[0] :]]
    assert [sum(len(mb) for mb in ep) for ep in per_epoch] == [n_tokens, n_tokens]  # every token once per epoch

    state = json.loads((ckpt / "balancer_sampler.json").read_text())
    assert (state["epoch"], state["position"]) == (1, 2 * (STOP - steps[0]))
    resumed = _trainer(ckpt.parent)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert first.order + resumed.order == full.order
    assert resumed.state.global_step == sum(steps)
    for (name, a), b in zip(resumed.model.named_parameters(), full.model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name


def test_resume_onto_another_topology_replans_the_rest_of_the_epoch(runs, tmp_path):
    full, first, ckpt = runs
    resumed = _trainer(tmp_path, micro_batches=3)  # 3 micro-batches per step from here on
    resumed.train(resume_from_checkpoint=str(ckpt))
    done_in_epoch1 = first.order[2 * 4 :]  # epoch 0 has 4 steps of 2 micro-batches
    assert len(resumed.order) % 3 == 0 and resumed.state.global_step == STOP + len(resumed.order) // 3
    assert resumed.state.global_step == resumed.state.max_steps  # the re-planned remainder sets the step count
    # epoch 1 = what the first run did + what the resumed run re-planned: every token once, nothing repeated
    seen = sorted(t for mb in done_in_epoch1 + resumed.order for t in mb)
    assert seen == sorted(t for r in ROWS for t in r)


def test_resume_from_a_mid_step_sampler_state_is_refused(runs, tmp_path):
    """A sampler state between two optimizer steps would make the loop run a different number of steps: refused,
    naming the position and the step size."""
    import shutil

    _, _, ckpt = runs
    edited = tmp_path / ckpt.name
    shutil.copytree(ckpt, edited)
    state = json.loads((edited / "balancer_sampler.json").read_text())
    state["position"] += 1
    (edited / "balancer_sampler.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="do not match its digest: the state was edited"):  # edited by hand
        _trainer(tmp_path).train(resume_from_checkpoint=str(edited))
    from balancer.training.sampler_state import state_digest

    state["digest"] = state_digest(state)  # a consistent mid-step state (a sampler's own, not the trainer's)
    (edited / "balancer_sampler.json").write_text(json.dumps(state))
    resumed = _trainer(tmp_path)
    with pytest.raises(ValueError, match=rf"position {state['position']} is not at a step boundary.*micro_batches = 2"):
        resumed.train(resume_from_checkpoint=str(edited))
