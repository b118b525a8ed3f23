"""balancer.hf.BalancedTrainer on a BalancedStream over a local JSONL `datasets` streaming source (tiny Llama, one
process): two passes of one step each train the same weights as the map-style sampler path on the same documents,
every document is trained once per pass, a checkpointed run resumes exactly, and a stream without max_steps is
refused naming it."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from support.trainer import relative_error, tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # transformers Trainer runs

# fp32: the stream and the sampler pack the same documents into other micro-batches (other summation orders); the
# sampler path itself is held to this bound against unpacked training (tests/training/test_trainer.py)
TOL = 3e-4


def _jsonl_stream_source(tmp_path, rows):
    paths = []
    for i, part in enumerate((rows[: len(rows) // 2], rows[len(rows) // 2 :])):
        path = tmp_path / f"part-{i}.jsonl"
        path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in part))
        paths.append(str(path))
    return datasets.load_dataset("json", data_files=paths, split="train", streaming=True)


def _topology(rows, steps_per_pass: int):
    import balancer

    total = sum(len(r) for r in rows)
    return balancer.Topology(dp=1, cp=1, micro_batches=2, max_tokens=total, tokens_per_step=-(-total // steps_per_pass))


def _stream(tmp_path, rows, topo):
    import balancer
    from balancer.streaming import BalancedStream

    cost = balancer.CostModel.from_config(tiny_llama().config.to_dict())  # the trainer's default cost model
    return BalancedStream(_jsonl_stream_source(tmp_path, rows), topo, cost, window_docs=len(rows), seed=0)


def _recording(trainer) -> list:
    """Every row the trainer's collator packs (token ids), in order."""
    seen, collate = [], trainer.packed_collator

    def record(rows):
        seen.extend(tuple(int(t) for t in r["input_ids"]) for r in rows)
        return collate(rows)

    trainer.packed_collator = record
    return seen


def test_two_passes_equal_the_sampler_path(tmp_path):
    import balancer.hf

    rows = token_rows(24, seed=1)
    topo = _topology(rows, steps_per_pass=1)  # one step per pass: the step's gradient is that of every document
    stream = _stream(tmp_path, rows, topo)
    start = {n: p.detach().clone() for n, p in tiny_llama().named_parameters()}
    args = training_args(tmp_path / "stream", max_steps=2)
    streamed = balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=stream)
    assert streamed.args.gradient_accumulation_steps == topo.micro_batches and streamed.topology == topo
    seen = _recording(streamed)
    out = streamed.train()
    assert streamed.state.global_step == 2 and stream.epoch == 1  # the second step is the second pass
    assert Counter(seen) == Counter({tuple(r): 2 for r in rows})  # every document once per pass, whole

    ds = datasets.Dataset.from_dict({"input_ids": rows})
    args = training_args(tmp_path / "sampler", num_train_epochs=2)
    sampled = balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=ds, topology=topo, seed=0)
    ref = sampled.train()
    assert sampled.state.global_step == 2
    got = {n: p.detach() - start[n] for n, p in streamed.model.named_parameters()}
    want = {n: p.detach() - start[n] for n, p in sampled.model.named_parameters()}
    err = relative_error(got, want)
    assert err <= TOL, err
    assert abs(out.training_loss - ref.training_loss) <= TOL * ref.training_loss, (out.training_loss, ref)
    assert torch.isfinite(torch.tensor(out.training_loss))


def _streaming_trainer(tmp_path, rows, topo, out, max_steps: int, save_steps: int):
    import balancer.hf

    stream = _stream(tmp_path, rows, topo)
    args = training_args(tmp_path / out, max_steps=max_steps, save_strategy="steps", save_steps=save_steps)
    return balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=stream)


# (steps per pass, max_steps, checkpoint step, the pass training ends in): a checkpoint mid-pass (a pass and a
# half), and one at the very end of a pass (the resumed pass has nothing left: training goes on with the next)
RESUMES = {"mid-pass": (4, 6, 3, 1), "end-of-pass": (1, 3, 1, 2)}


@pytest.mark.parametrize("case", list(RESUMES))
def test_checkpoint_resume_continues_the_stream_exactly(tmp_path, case):
    from transformers import TrainerCallback

    per_pass, max_steps, stop, last_pass = RESUMES[case]
    rows = token_rows(40, seed=3)
    topo = _topology(rows, steps_per_pass=per_pass)
    whole = _streaming_trainer(tmp_path, rows, topo, "whole", max_steps, stop)
    seen_whole = _recording(whole)
    whole.train()
    assert whole.state.global_step == max_steps and whole.balanced_stream.epoch == last_pass

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= stop

    first = _streaming_trainer(tmp_path, rows, topo, "run", max_steps, stop)
    first.add_callback(Stop())
    seen_first = _recording(first)
    first.train()
    checkpoint = tmp_path / "run" / f"checkpoint-{stop}"
    state = json.loads((checkpoint / "balancer_stream.json").read_text())
    assert state["position"] % topo.micro_batches == 0

    resumed = _streaming_trainer(tmp_path, rows, topo, "run", max_steps, stop)
    seen_rest = _recording(resumed)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == max_steps and resumed.balanced_stream.epoch == last_pass
    assert seen_first + seen_rest == seen_whole  # the same documents in the same order, none twice
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_a_stream_without_max_steps_is_refused(tmp_path):
    import balancer.hf

    rows = token_rows(8, seed=4)
    stream = _stream(tmp_path, rows, _topology(rows, steps_per_pass=1))
    with pytest.raises(ValueError, match="max_steps"):
        balancer.hf.BalancedTrainer(model=tiny_llama(), args=training_args(tmp_path / "o"), train_dataset=stream)


def _dp2_streaming_run(rank, world, rows, folder):
    from pathlib import Path

    import torch.distributed as dist

    import balancer
    import balancer.hf

    folder = Path(folder)
    args = training_args(folder / "dp2", max_steps=2)
    assert args.world_size == 2 and dist.is_initialized()  # the arguments set up the process group (accelerate)
    total = sum(len(r) for r in rows)
    topo = balancer.Topology(dp=2, cp=1, micro_batches=2, max_tokens=total, tokens_per_step=total)
    model = tiny_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = balancer.hf.BalancedTrainer(model=model, args=args, train_dataset=_stream(folder, rows, topo))
    seen = _recording(trainer)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.dp_rank == rank
    torch.save({"seen": seen, "delta": {n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}},
               folder / f"rank{rank}.pt")  # fmt: skip


def test_dp2_stream_equals_the_one_process_sampler_path(tmp_path):
    """Two gloo processes as dp2 on a stream (the global loss normaliser's all-reduce, DDP) against one process on
    the sampler path: one step per pass, so every step's gradient is the mean over every document on both."""
    from support.trainer import run_torchrun_world

    import balancer.hf

    rows = token_rows(24, seed=5)
    run_torchrun_world(2, _dp2_streaming_run, rows, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert Counter(got[0]["seen"] + got[1]["seen"]) == Counter({tuple(r): 2 for r in rows})  # once per pass
    start = {n: p.detach().clone() for n, p in tiny_llama().named_parameters()}
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    args = training_args(tmp_path / "sampler", num_train_epochs=2)
    sampled = balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=ds, topology=_topology(rows, 1))
    sampled.train()
    want = {n: p.detach() - start[n] for n, p in sampled.model.named_parameters()}
    for r in range(2):
        err = relative_error(got[r]["delta"], want)
        assert err <= TOL, (r, err)


def test_the_sft_trainer_refuses_a_stream(tmp_path):
    import balancer.hf

    pytest.importorskip("trl")
    rows = token_rows(8, seed=4)
    stream = _stream(tmp_path, rows, _topology(rows, steps_per_pass=1))
    with pytest.raises(ValueError, match="BalancedSFTTrainer does not take a BalancedStream"):
        balancer.hf.BalancedSFTTrainer(model=tiny_llama(), train_dataset=stream)
