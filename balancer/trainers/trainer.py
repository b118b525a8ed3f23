"""Hugging Face ``transformers.Trainer`` and TRL ``SFTTrainer`` on balanced, packed data (import ``balancer.hf``).

What the two classes change in the stock training loop (everything else - optimizer, scheduler, logging,
checkpoints, DDP/FSDP through accelerate - is the stock Trainer's):

- data: ``BalancedBatchSampler`` (this DP rank's micro-batches of the epoch's plan) + ``PackedCollator`` (one packed
  sequence per micro-batch, cut to this CP rank's share), in a plain DataLoader;
- gradient accumulation = the plan's ``micro_batches``; the optimizer step = the plan's step;
- loss = ``balancer.loss.token_loss``: the summed token cross-entropy divided by the step's global loss-token count
  (all DP ranks, all micro-batches; one integer all-reduce per step), times the process count because DDP averages
  gradients: the gradient is exactly the one of the step's mean token loss;
- attention: the model is switched to ``attention.hf.NAME``, which reads the packed layout (exact CP attention over
  the CP group when ``topology.cp > 1``, packed single-device attention when ``cp == 1``; with dynamic CP,
  ``Topology(cp_sizes=...)``, over the group each batch names); ranks come from torch.distributed:
  rank = dp_rank * cp + cp_rank;
- logged loss: every rank's figure is its share of the step's mean token loss; a logging step averages the
  shares over the processes (times the process count above: their sum), and so does the final ``train_loss``,
  which the stock loop would take from this rank alone: both are the true step means over all ranks;
- evaluation: packed, balanced eval batches and a token-weighted ``eval_loss`` (eval.py); no topology
  given: data parallel over the launched processes (defaults.py);
- epochs: the number of optimizer steps of every epoch comes from its own plan (plans of different seeds can differ
  by a step); resume reads the sampler state saved in the checkpoint (``balancer_sampler.json``) and continues the
  epoch at the exact micro-batch, also after a change of topology at a step boundary.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

try:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - exercised without transformers only
    raise ImportError("balancer.hf needs transformers and accelerate: pip install 'seqbalancer[trainer]'") from exc

from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES
from balancer.trainers.balance import MeasuredBalanceMixin
from balancer.trainers.defaults import default_topology
from balancer.trainers.eval import BalancedEvalMixin, eval_lengths
from balancer.trainers.loss_log import process_mean
from balancer.trainers.options import check_trainer_options
from balancer.trainers.stream import StreamTrainingMixin, is_stream, stream_settings, write_state
from balancer.training.collate import PackedCollator
from balancer.training.indices import SpanDataset
from balancer.training.lengths import resolve_lengths
from balancer.training.loss import token_loss
from balancer.training.sampler import BalancedBatchSampler
from balancer.training.sampler_state import read_checkpoint_state

logger = logging.getLogger(__name__)

SAMPLER_STATE_NAME = "balancer_sampler.json"
# Trainer internals the integration relies on (present in transformers 5.x)
_REQUIRED_HOOKS = ("_run_epoch", "_init_training_state", "set_initial_training_values", "_get_num_items_in_batch")


def check_topology(topology: Topology) -> None:
    """Refuse what the Trainer integration cannot run, with the reason."""
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a balancer.Topology, got {type(topology).__name__}")
    if topology.pp != 1:
        raise ValueError(f"pipeline parallelism (pp={topology.pp}) is not supported by the Trainer integration: pp=1")


def check_eval_kwargs(kwargs: dict) -> None:
    """Refuse what balanced evaluation cannot give (per-example predictions for `compute_metrics`)."""
    for name in ("compute_metrics", "preprocess_logits_for_metrics"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name} is not supported by the balanced trainer: its eval batches are packed (and CP-sharded), so "
                "there are no per-example predictions; it reports the token-weighted eval_loss"
            )


_Args = TypeVar("_Args", bound=TrainingArguments)


def balanced_args(args: _Args, topology: Optional[Topology]) -> _Args:
    """A copy of ``args`` whose gradient accumulation is the plan's micro-batches; a conflicting explicit value is an
    error (1, the default, is taken as unset). Without a topology the default one takes ``args``' accumulation."""
    for hook in _REQUIRED_HOOKS:
        if not hasattr(Trainer, hook):
            import transformers

            raise ImportError(
                f"balancer.hf needs transformers >= 5 (Trainer.{hook}); installed: {transformers.__version__}"
            )
    m = args.gradient_accumulation_steps if topology is None else topology.micro_batches
    if args.gradient_accumulation_steps not in (1, m):
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} conflicts with the plan: an optimizer "
            f"step is the topology's micro_batches={m} micro-batches; leave gradient_accumulation_steps unset (or "
            f"set it to {m}), and change Topology(micro_batches=...) instead"
        )
    args = copy.copy(args)
    args.gradient_accumulation_steps = m
    return args


class BalancedTrainingMixin(BalancedEvalMixin, StreamTrainingMixin, MeasuredBalanceMixin):
    """The balanced data loader, loss, attention, evaluation and resume logic shared by both Trainer classes
    (measured balance, `balance_mode=`, in balance.py; a streaming train_dataset in stream.py)."""

    loss_is_scaled_for_ga: bool | None = True  # compute_loss already divides by the whole step's loss-token count

    # ---- set-up ----------------------------------------------------------------------------------------------
    def _balanced_setup(
        self,
        topology: Optional[Topology],
        cost: Optional[CostModel],
        lengths,
        overflow: str,
        layout: str,
        cp_method: str,
        attention_backend: str,
        seed: Optional[int],
        max_length: Optional[int] = None,
        filler_rows: bool = False,
    ) -> None:
        import attention.hf as ahf

        stream = self.train_dataset if is_stream(self.train_dataset) else None
        if stream is not None:
            topology, cost, overflow, seed = stream_settings(self, stream, topology, cost, lengths, overflow, seed)
        else:
            lengths, _ = resolve_lengths(self.train_dataset if lengths is None else lengths, self.train_dataset)
        self.eval_dataset = _eval_datasets(self.eval_dataset)
        given = topology is not None
        if topology is None:
            longest = max((int(eval_lengths(d).max()) for d in _eval_list(self.eval_dataset) if len(d)), default=0)
            topology = default_topology(self.args, lengths, max_length, longest)
        check_topology(topology)
        check_trainer_options(cp_method=cp_method, attention_backend=attention_backend, filler_rows=filler_rows)
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        model: Any = self.model  # a transformers PreTrainedModel (config, set_attn_implementation)
        if cost is None:
            cost = CostModel.from_config(model.config.to_dict())
        ahf.register()
        if getattr(model.config, "_attn_implementation", None) != ahf.NAME:
            logger.info(
                "switching the model's attention from %r to %r (packed batches need document-aware attention)",
                model.config._attn_implementation,
                ahf.NAME,
            )
            model.set_attn_implementation(ahf.NAME)
        self.topology, self.cost_model = topology, cost
        self.cp_method, self.attention_backend = cp_method, attention_backend
        self.dp_rank, self.cp_rank, self._cp_groups = _ranks(topology)
        self._overflow, self._plan_seed = overflow, self.args.seed if seed is None else seed
        self.balanced_stream = stream
        self.balanced_sampler: Optional[BalancedBatchSampler] = None  # a stream plans itself: stream.py
        if stream is None:
            self.balanced_sampler = BalancedBatchSampler(
                lengths,
                topology,
                cost,
                rank=self.dp_rank * topology.cp + self.cp_rank,
                seed=self._plan_seed,
                overflow=overflow,
                filler_rows=filler_rows,
            )
        # dynamic CP: every batch names its own group (carried by the sampler's indices through SpanDataset)
        cp_rank, cp_size = (0, 1) if topology.dynamic else (self.cp_rank, topology.cp)
        self.packed_collator = PackedCollator(cp_rank=cp_rank, cp_size=cp_size, layout=layout, dp_rank=self.dp_rank)
        if stream is None and (overflow != "error" or topology.dynamic or filler_rows):
            self.train_dataset = SpanDataset(self.train_dataset)
        self._resume_epoch: Optional[int] = None
        self._epoch_start = (0, 0)  # (sampler step, global step) when the current epoch's loop began
        self._steps_per_epoch: dict[int, int] = {}
        if self.args.per_device_train_batch_size != 1 and given:
            logger.info("per_device_train_batch_size is not used: the plan's micro-batches are the batches")

    # ---- data ------------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """This rank's balanced, packed micro-batches (the sampler is rank-aware: not re-sharded by accelerate)."""
        if self.balanced_stream is not None:
            return super().get_train_dataloader()
        a = self.args
        kwargs: dict[str, Any] = dict(num_workers=a.dataloader_num_workers, pin_memory=a.dataloader_pin_memory)
        if a.dataloader_num_workers > 0:
            kwargs.update(
                persistent_workers=a.dataloader_persistent_workers,
                prefetch_factor=a.dataloader_prefetch_factor,
                multiprocessing_context=a.dataloader_multiprocessing_context,
            )
        if self.train_dataset is None:
            raise ValueError("training needs a train_dataset")
        return torch.utils.data.DataLoader(
            self.train_dataset, batch_sampler=self._fixed_sampler(), collate_fn=self.packed_collator, **kwargs
        )

    def _fixed_sampler(self) -> BalancedBatchSampler:
        """The sampler of a train_dataset that is not a stream (a stream plans itself: stream.py)."""
        if self.balanced_sampler is None:
            raise RuntimeError("a streaming train_dataset has no BalancedBatchSampler")
        return self.balanced_sampler

    def _epoch_num_steps(self, epoch: int) -> int:
        """Optimizer steps of `epoch`'s plan (plans of different seeds may differ by a step)."""
        if epoch not in self._steps_per_epoch:
            logger.info("counting the optimizer steps of epoch %d", epoch)
            self._steps_per_epoch[epoch] = self._fixed_sampler().epoch_num_steps(epoch)
        return self._steps_per_epoch[epoch]

    def _planned_steps(self, first_epoch: int = 0) -> int:
        """Optimizer steps of epochs `first_epoch`.. of `num_train_epochs` (a fraction of the last one rounded up)."""
        whole = int(math.floor(self.args.num_train_epochs))
        total = sum(self._epoch_num_steps(e) for e in range(first_epoch, whole))
        frac = self.args.num_train_epochs - whole
        if frac > 0 and whole >= first_epoch:
            total += math.ceil(frac * self._epoch_num_steps(whole))
        return total

    def set_initial_training_values(
        self, args: TrainingArguments, dataloader: torch.utils.data.DataLoader
    ) -> tuple[int, int, int, int, int, int | None, int]:
        values: list[Any] = list(super().set_initial_training_values(args, dataloader))
        if args.max_steps > 0:  # training stops at max_steps; one epoch of margin for epochs a step shorter
            values[0] += 1
        else:  # the exact count over the epochs, each with its own plan
            values[6] = self._planned_steps()
        return tuple(values)

    # ---- resume ----------------------------------------------------------------------------------------------
    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        epochs_trained, skipped = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        self._resume_epoch = None
        self._flops_parameters = None  # counted again for every train() (the model may have changed in between)
        if self.balanced_stream is not None or resume_from_checkpoint is None or self.args.ignore_data_skip:
            return epochs_trained, skipped
        path, state = read_checkpoint_state(
            resume_from_checkpoint, SAMPLER_STATE_NAME, "a balanced trainer", "resume at the start of the epoch"
        )
        sampler = self._fixed_sampler()
        sampler.load_state_dict(state)
        end = len(sampler)
        done, mid = sampler.step_of(sampler.position) if sampler.position < end else (sampler.num_steps, 0)
        if mid:  # the loop counts whole optimizer steps
            raise ValueError(
                f"{path}: the sampler state's position {sampler.position} is not at a step boundary (a multiple of "
                f"micro_batches = {self.topology.micro_batches} micro-batches per step): the checkpoint was not "
                "written by this trainer at the end of an optimizer step"
            )
        if self.args.max_steps <= 0:  # what is left of this epoch (re-planned after a topology change) and the rest
            left = sampler.num_steps - done
            self.state.max_steps = self.state.global_step + left + self._planned_steps(sampler.epoch + 1)
        if sampler.position >= end:  # saved at the end: next epoch
            return sampler.epoch + 1, 0
        self._resume_epoch = sampler.epoch
        return sampler.epoch, 0

    def _run_epoch(self, **kwargs):  # type: ignore[override]  # the stock loop passes every argument by keyword
        """One epoch of the stock loop, told this epoch's own length (and, when resuming, what is left of it)."""
        if self.balanced_stream is not None:
            return super()._run_epoch(**kwargs)
        epoch = kwargs["epoch"]
        sampler = self._fixed_sampler()
        sampler.set_epoch(epoch)  # keeps a loaded resume position when it is this epoch's
        start = sampler.position if epoch == self._resume_epoch else 0
        self._resume_epoch = None
        remaining = len(sampler) - start  # exact; a short last step (M' micro-batches) included
        first_step = sampler.step_of(start)[0] if start else 0
        _check_short_steps(sampler, first_step, remaining, epoch)
        self._epoch_start = (first_step, self.state.global_step)
        kwargs.update(  # the stock loop runs a last update of `steps_in_epoch % accumulation` micro-batches
            steps_in_epoch=remaining,
            num_update_steps_per_epoch=sampler.num_steps - first_step,
            steps_trained_in_current_epoch=0,
        )
        return super()._run_epoch(**kwargs)

    def sampler_state(self) -> dict:
        """The sampler's resume state at the last finished optimizer step (what a checkpoint saves)."""
        first_step, step0 = self._epoch_start
        sampler = self._fixed_sampler()
        step = min(first_step + self.state.global_step - step0, sampler.num_steps)
        return sampler.state_dict(position=sampler.position_of_step(step))

    def _save_checkpoint(self, model, trial) -> None:
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # before the Trainer's own files: trainer_state.json, written last, marks it done
        if self.balanced_stream is None and self.args.should_save:
            write_state(folder, SAMPLER_STATE_NAME, self.sampler_state())
        super()._save_checkpoint(model, trial)

    def _finalize_training(self, trial, num_train_samples, start_time):
        """The stock Trainer adds the loss accumulated since the last log to `train_loss` as this rank's own figure;
        here every rank holds only its share of each step's globally normalised loss, so average the shares over
        the processes first, exactly as a logging step does (all ranks reach this point: it is a collective)."""
        self._tr_loss = process_mean(self._tr_loss)
        return super()._finalize_training(trial, num_train_samples, start_time)

    # ---- FLOPs ---------------------------------------------------------------------------------------------------
    _flops_parameters: Optional[int] = None

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The stock estimate, 6 x the micro-batch's input tokens x the model's non-embedding parameters, with the
        parameter count taken once per `train()` (the stock Trainer walks every module and parameter of the model
        for every micro-batch)."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._flops_parameters is None:
            model: Any = self.model  # a transformers PreTrainedModel here (checked above)
            self._flops_parameters = int(model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main].numel() * self._flops_parameters

    # ---- loss ------------------------------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device) -> int:
        """The step's global loss-token count: the collator counts a micro-batch over all ranks of its CP group, so
        only the group's first rank contributes it to the sum over all processes."""
        local = sum(int(b["num_loss_tokens"]) for b in batch_samples if b["cp_rank"] == 0)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            on = torch.device("cpu") if dist.get_backend() == "gloo" else self.args.device
            t = torch.tensor([local], dtype=torch.int64, device=on)
            dist.all_reduce(t)
            local = int(t.item())
        return max(local, 1)  # a step without loss tokens gives a zero loss, not 0/0

    def _layout_context(self, model, inputs):
        import attention.hf as ahf

        if "layout" not in inputs:
            raise ValueError("the balanced trainer trains on PackedCollator batches (no 'layout' in the batch)")
        group = self._cp_groups[tuple(inputs["cp_group_key"])] if self._cp_groups else None
        return ahf.cp_context(
            inputs["layout"], group=group, method=self.cp_method, backend=self.attention_backend, model=model
        )

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The stock step (forward + backward) inside the batch's CP layout: activation checkpointing recomputes
        attention during the backward pass, which needs the layout too."""
        with self._layout_context(model, inputs):
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Packed forward; token cross-entropy over the step's global loss-token count."""
        # _get_num_items_in_batch gives the step's global count (an int); alone, the micro-batch's own
        n = int(num_items_in_batch) if num_items_in_batch is not None else max(int(inputs["num_loss_tokens"]), 1)
        with self._layout_context(model, inputs):
            outputs = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False)
        # DDP (and FSDP) average the gradients over the processes; the loss is normalised globally, so undo that
        loss = token_loss(outputs.logits, inputs["labels"], n) * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss


def _check_short_steps(sampler, first_step: int, remaining: int, epoch: int) -> None:
    """The stock loop accumulates `micro_batches` micro-batches per optimizer step and runs a shorter update only
    at the end of an epoch: refuse an epoch with a short step (M' < M) anywhere else (windowed planning of
    fixed-length rows whose windows cannot fill their last steps) instead of mixing steps."""
    m, steps = sampler.topology.micro_batches, sampler.num_steps
    if steps <= first_step:
        return
    last = sampler.step_micro_batches(steps - 1)
    if remaining != (steps - first_step - 1) * m + last:
        raise ValueError(
            f"epoch {epoch}: a planning window's fixed-length rows cannot fill its last step, which runs fewer than "
            f"micro_batches = {m} micro-batches inside the epoch; the Trainer runs a short optimizer step only at the "
            "end of an epoch: choose Topology.dp and Topology.micro_batches so that every window's rows fill its steps"
        )


def _eval_list(eval_dataset) -> list:
    """The eval datasets as a list (none, one, or a dict's values)."""
    if eval_dataset is None:
        return []
    return list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]


def _eval_datasets(eval_dataset):
    """The eval dataset(s) reduced to their token columns (a dict's values one by one)."""
    if isinstance(eval_dataset, dict):
        return {k: _dataset_for_packing(v) for k, v in eval_dataset.items()}
    return None if eval_dataset is None else _dataset_for_packing(eval_dataset)


def _ranks(topology: Topology) -> tuple[int, int, dict]:
    """(dp_rank, cp_rank, CP process groups keyed by `(start, size)`) from torch.distributed; rank = dp_rank * cp +
    cp_rank. No groups for one process or for a static topology with cp = 1."""
    from balancer.training.groups import cp_groups

    world = topology.dp * topology.cp
    if not (dist.is_available() and dist.is_initialized()):
        if world != 1:
            raise ValueError(
                f"the topology has dp*cp = {topology.dp}*{topology.cp} = {world} ranks but torch.distributed is not "
                f"initialised: launch {world} processes (torchrun --nproc-per-node {world} ... or accelerate launch "
                f"--multi_gpu --num_processes {world} ...)"
            )
        return 0, 0, {}
    if dist.get_world_size() != world:
        raise ValueError(
            f"torch.distributed has {dist.get_world_size()} processes but the topology needs dp*cp = "
            f"{topology.dp}*{topology.cp} = {world}"
        )
    dp_rank, cp_rank = divmod(dist.get_rank(), topology.cp)
    groups = cp_groups(topology) if (topology.cp > 1 or topology.dynamic) else {}  # collective, same order
    return dp_rank, cp_rank, groups


def _dataset_for_packing(dataset):
    """A `datasets.Dataset` reduced to its token columns, rows as numpy arrays; other datasets as they are."""
    try:
        import datasets
    except ImportError:  # pragma: no cover
        return dataset
    if isinstance(dataset, datasets.Dataset):
        if "input_ids" not in dataset.column_names:
            raise ValueError(
                f"the training dataset has no 'input_ids' column (columns: {dataset.column_names}): tokenize it first "
                "(or use BalancedSFTTrainer with a text column and a tokenizer)"
            )
        keep = [c for c in ("input_ids", "labels") if c in dataset.column_names]
        return dataset.select_columns(keep).with_format("numpy")
    return dataset


class BalancedTrainer(BalancedTrainingMixin, Trainer):
    """``transformers.Trainer`` on balanced, packed data (see the module docstring).

    Args (besides the Trainer's own):
        train_dataset: rows with ``input_ids`` (and optionally ``labels``, -100 = no loss): a ``datasets.Dataset``,
            a ``balancer.ShardDataset``, or any map-style dataset (then pass ``lengths``); or a
            ``balancer.BalancedStream`` (then ``max_steps`` is required and the stream's topology, cost model, seed and
            overflow policy are the run's: stream.py).
        topology: the run's ``balancer.Topology`` (dp * cp processes; pp = 1; static or dynamic CP); None: data
            parallel over the launched processes, with gradient accumulation and a token budget from ``args`` and
            the data (``balancer.trainers.defaults``).
        eval_dataset: evaluated on packed, balanced batches (``eval_strategy="steps"|"epoch"`` or ``evaluate()``);
            ``eval_loss`` is the token-weighted mean (``balancer.trainers.eval``).
        cost: the ``CostModel``; default ``CostModel.from_config(model.config)``.
        lengths: token count per row, when the dataset cannot give them cheaply.
        overflow: the planner's policy for documents longer than ``max_tokens * cp`` ("error", "split", "truncate").
        layout: the CP layout kind of ``PackedCollator``; cp_method: "ring" or "allgather"; attention_backend: as for
            ``attention.cp_attention``; seed: the plan's seed (default ``args.seed``).
        filler_rows: fixed-length rows that no short last step splits equally over the replicas get loss-masked
            filler rows (``BalancedBatchSampler(filler_rows=True)``) instead of an error.
    """

    def __init__(
        self,
        model=None,
        args: Optional[TrainingArguments] = None,
        train_dataset=None,
        *,
        topology: Optional[Topology] = None,
        cost: Optional[CostModel] = None,
        lengths=None,
        overflow: str = "error",
        layout: str = "zigzag",
        cp_method: str = "ring",
        attention_backend: str = "auto",
        seed: Optional[int] = None,
        filler_rows: bool = False,
        **kwargs,
    ) -> None:
        if topology is not None:
            check_topology(topology)
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        check_eval_kwargs(kwargs)
        if topology is None and is_stream(train_dataset):
            topology = train_dataset.topology
        args = balanced_args(args if args is not None else TrainingArguments(output_dir="trainer_output"), topology)
        super().__init__(model=model, args=args, train_dataset=_dataset_for_packing(train_dataset), **kwargs)
        self._balanced_setup(
            topology, cost, lengths, overflow, layout, cp_method, attention_backend, seed, filler_rows=filler_rows
        )
