"""`BalancedTrainer` on a streaming `train_dataset`: a `balancer.streaming.BalancedStream` (docs/streaming.md).

What changes against the sampler path (trainer.py), everything else (loss, attention, CP groups, logging) shared:

- the topology, cost model, seed and overflow policy are the stream's (a differing explicit one is refused);
- `TrainingArguments.max_steps` is required (a stream has no length, as for the stock Trainer);
- the data loader is `DataLoader(stream, batch_size=None, collate_fn=<the trainer's PackedCollator>)`, no sampler,
  no workers (the stream reads, plans and exchanges on its own thread);
- gradient accumulation = the topology's micro_batches; the loss normaliser is the step's global loss-token count
  from the collator's counts (one all-reduce, the sampler path's `_get_num_items_in_batch`);
- a Trainer epoch is one pass of the stream (`set_epoch(epoch)`); a pass ends when the stream does (every rank
  yields the same number of whole steps), and the next pass replays the source;
- a checkpoint holds the stream's state (`balancer_stream.json`, no communication to build: the same on every
  rank); resume loads it and continues the pass at the saved step (no batches skipped by the Trainer);
- `train()` closes the stream when it returns or raises (its background thread and process group released);
- measured balance (`balance_mode`, default "shadow") runs its monitor on `StreamSteps(stream)`
  (balancer.measured.streams): the fits of adapt mode reach the stream's windows not planned yet, and the monitor's
  state travels in `balancer_stream.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch

from balancer.files import atomic_write
from balancer.streaming.dataset import BalancedStream
from balancer.trainers.host import TrainerHost
from balancer.training.sampler_state import read_checkpoint_state

if TYPE_CHECKING:
    from balancer.planning.cost.model import CostModel
    from balancer.planning.topology import Topology

STREAM_STATE_NAME = "balancer_stream.json"


def is_stream(dataset: object) -> TypeGuard[BalancedStream]:
    return isinstance(dataset, BalancedStream)


def write_state(folder: str, name: str, state: dict) -> None:
    """`state` as JSON in `folder/name` through `balancer.files.atomic_write` (fsynced, renamed over the old file;
    a symbolic link there is refused, naming it, and neither it nor its target is touched)."""
    atomic_write(os.path.join(folder, name), lambda f: f.write(json.dumps(state).encode()))


def stream_settings(
    trainer: TrainerHost,
    stream: BalancedStream,
    topology: Optional[Topology],
    cost: Optional[CostModel],
    lengths: Any,
    overflow: str,
    seed: Optional[int],
) -> tuple[Topology, CostModel, str, int]:
    """(topology, cost, overflow, seed) of a streaming run: the stream's. Refuses a missing `max_steps`, options the
    stream fixes that differ from it, and `lengths`."""
    if trainer.args.max_steps is None or trainer.args.max_steps <= 0:
        raise ValueError(
            f"max_steps={trainer.args.max_steps}: a BalancedStream train_dataset has no length; set "
            "TrainingArguments(max_steps=N) (N > 0 optimizer steps), as the stock Trainer requires for streams"
        )
    if topology is not None and topology != stream.topology:
        raise ValueError(f"topology={topology} differs from the stream's {stream.topology}: pass it to one of them")
    if cost is not None and cost != stream.cost:
        raise ValueError("cost differs from the stream's cost model: the stream plans its windows with its own")
    if lengths is not None:
        raise ValueError("lengths is not used with a BalancedStream train_dataset (the stream gathers them)")
    if overflow not in ("error", stream.overflow):
        raise ValueError(f"overflow={overflow!r} differs from the stream's {stream.overflow!r}")
    if seed is not None and seed != stream.seed:
        raise ValueError(f"seed={seed} differs from the stream's seed {stream.seed}")
    if trainer.args.dataloader_num_workers > 0:
        raise ValueError(
            f"dataloader_num_workers={trainer.args.dataloader_num_workers}: a BalancedStream runs in the training "
            "process (its reading, planning and exchange run on its own thread): set dataloader_num_workers=0"
        )
    return stream.topology, stream.cost, stream.overflow, stream.seed


class StreamTrainingMixin(TrainerHost):
    """The streaming parts of the balanced trainer (module docstring); inactive while `balanced_stream` is None.
    Sits after `BalancedTrainingMixin` in the class order: the sampler path's overrides hand streams on to it."""

    balanced_stream: BalancedStream | None = None
    _stream_resumed = None  # the stream epoch a checkpoint's state was loaded for
    _stream_batches = 0

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The stock `train`; a streaming run then closes its stream (`BalancedStream.close()`: its thread and
        process group released, so a run stopped at `max_steps` mid-pass exits cleanly), also when training
        raises. A stream trains once: build a new one (and resume from a checkpoint) to go on; a second `train()`
        on the closed stream is refused up front, before any set-up."""
        stream = self.balanced_stream
        if stream is not None and stream.closed:
            from balancer.streaming.teardown import StreamClosed

            raise StreamClosed(
                "BalancedTrainer.train() on a BalancedStream runs once (it closes the stream when it returns): to go "
                "on, build a new BalancedStream and BalancedTrainer and pass train(resume_from_checkpoint=...)"
            )
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.balanced_stream is not None:
                self.balanced_stream.close()

    def _balance_source(self):
        """The monitor's step source: `StreamSteps` on the stream (built, as on the sampler path, before a
        checkpoint's stream state, which holds the monitor's, is loaded); the sampler path's otherwise."""
        if self.balanced_stream is None:
            return super()._balance_source()
        from balancer.measured.streams import StreamSteps

        return StreamSteps(self.balanced_stream)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """The stream's micro-batches packed by the trainer's collator (the stream is rank-aware: not re-sharded)."""
        stream = self.balanced_stream
        if stream is None:
            return super().get_train_dataloader()
        if stream.pool_rank != self.dp_rank * self.topology.cp + self.cp_rank:
            raise ValueError(
                f"the stream's rank {stream.pool_rank} is not this process's dp_rank * cp + cp_rank = "
                f"{self.dp_rank * self.topology.cp + self.cp_rank}: build the stream with the trainer's ranks"
            )
        return torch.utils.data.DataLoader(
            stream, batch_size=None, collate_fn=self.packed_collator, pin_memory=self.args.dataloader_pin_memory
        )

    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, torch.Tensor | int | None]:
        """One optimizer step's micro-batches; the end of the stream's pass ends the Trainer's epoch (every rank
        reaches it at the same step, so the normaliser's all-reduce is skipped alike)."""
        if self.balanced_stream is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch = []
        for _ in range(num_batches):
            try:
                batch.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batch:
            self.control.should_epoch_stop = True
            return [], None
        if len(batch) != num_batches:
            raise RuntimeError(
                f"the stream ended mid-step ({len(batch)} of {num_batches} micro-batches): it yields whole steps"
            )
        self._stream_batches += len(batch)
        return batch, self._get_num_items_in_batch(batch, device)

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        epochs_trained, skipped = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        stream = self.balanced_stream
        if stream is None:
            return epochs_trained, skipped
        self._stream_resumed = None
        if resume_from_checkpoint is None or self.args.ignore_data_skip:
            return 0, 0
        path, state = read_checkpoint_state(
            resume_from_checkpoint, STREAM_STATE_NAME, "a streaming balanced trainer", "restart the stream"
        )
        stream.load_state_dict(state)
        m = self.topology.micro_batches
        if state["position"] % m:
            raise ValueError(
                f"{path}: the stream state's position {state['position']} is not at a step boundary (a multiple of "
                f"micro_batches = {m}): the checkpoint was not written by this trainer after an optimizer step"
            )
        self._stream_resumed = stream.epoch
        return stream.epoch, 0

    def _run_epoch(self, **kwargs):  # type: ignore[override]  # the stock loop passes every argument by keyword
        """One pass of the stream (the rest of it for a resumed pass), through the stock epoch loop."""
        stream = self.balanced_stream
        if stream is None:
            return super()._run_epoch(**kwargs)
        epoch = kwargs["epoch"]
        resumed = epoch == self._stream_resumed
        stream.set_epoch(epoch)  # keeps a loaded state of this epoch
        self._stream_resumed, self._stream_batches = None, 0
        kwargs.update(steps_trained_in_current_epoch=0)
        out = super()._run_epoch(**kwargs)
        if resumed and self._stream_batches == 0 and self.state.global_step < self.state.max_steps:
            self.control.should_training_stop = False  # saved at the very end of a pass: go on with the next
        return out

    def _save_checkpoint(self, model, trial) -> None:
        stream = self.balanced_stream
        if stream is not None and self.args.should_save:  # before trainer_state.json, which marks a checkpoint done
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            write_state(folder, STREAM_STATE_NAME, stream.state_dict())
        super()._save_checkpoint(model, trial)
