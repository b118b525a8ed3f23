"""TRL's ``SFTTrainer`` on balanced, packed data: TRL prepares the dataset (text or chat -> ``input_ids`` and
``labels`` with the prompt / non-assistant tokens masked), the balanced trainer does the rest (see
``balancer.trainers.trainer``)."""

from __future__ import annotations

from typing import Optional

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised without trl only
    raise ImportError("balancer.hf.BalancedSFTTrainer needs TRL: pip install 'seqbalancer[trainer]'") from exc

from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.trainers.stream import is_stream
from balancer.trainers.trainer import (
    BalancedTrainingMixin,
    _dataset_for_packing,
    balanced_args,
    check_eval_kwargs,
    check_topology,
)


# TRL's base trainer sets loss_is_scaled_for_ga = None, which mypy reads as the type None; transformers types it
# bool | None, and the mixin's True is what both read
class BalancedSFTTrainer(BalancedTrainingMixin, SFTTrainer):  # type: ignore[misc]
    """``trl.SFTTrainer`` on balanced, packed data.

    ``train_dataset`` is what SFTTrainer takes (a ``datasets.Dataset`` of text, prompt/completion or chat messages,
    tokenized with ``processing_class``; or already tokenized ``input_ids``). The plan does the packing and decides
    what happens to long documents (``overflow``), so ``SFTConfig`` must have ``packing=False``,
    ``padding_free=False``. With a ``topology``, ``max_length`` must be None (its default 1024 would truncate
    every longer document behind the plan's back); without one, ``max_length`` is the token budget (a micro-batch
    holds ``per_device_train_batch_size * max_length`` tokens, ``balancer.trainers.defaults``) and TRL's
    truncation is turned off: a longer document follows ``overflow``. ``eval_dataset`` is tokenized by TRL and
    evaluated on packed, balanced batches. Other arguments as for ``BalancedTrainer``.
    """

    def __init__(
        self,
        model,
        args: Optional[SFTConfig] = None,
        train_dataset=None,
        *,
        topology: Optional[Topology] = None,
        cost: Optional[CostModel] = None,
        overflow: str = "error",
        layout: str = "zigzag",
        cp_method: str = "ring",
        attention_backend: str = "auto",
        seed: Optional[int] = None,
        **kwargs,
    ) -> None:
        if is_stream(train_dataset):
            raise ValueError(
                "train_dataset: BalancedSFTTrainer does not take a BalancedStream yet; tokenize the stream and use "
                "balancer.hf.BalancedTrainer (docs/streaming.md)"
            )
        if topology is not None:
            check_topology(topology)
        if args is None:
            args = SFTConfig(output_dir="trainer_output", max_length=None if topology is not None else 1024)
        if not isinstance(args, SFTConfig):
            raise TypeError(f"args must be a trl.SFTConfig, got {type(args).__name__}")
        bad = [f"{k}={getattr(args, k)!r}" for k in ("packing", "padding_free") if getattr(args, k)]
        if args.max_length is not None and topology is not None:
            bad.append(f"max_length={args.max_length}")
        if bad:
            raise ValueError(
                f"SFTConfig({', '.join(bad)}): the balanced trainer packs and plans lengths itself; set packing=False, "
                "padding_free=False and, with a topology, max_length=None (documents longer than topology "
                "max_tokens*cp follow overflow='error'|'split'|'truncate'); without a topology max_length is the "
                "token budget"
            )
        check_eval_kwargs(kwargs)
        budget = args.max_length if topology is None else None
        args = balanced_args(args, topology)
        args.max_length = None  # TRL would truncate to it: the plan decides what happens to long documents
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        self.train_dataset = _dataset_for_packing(self.train_dataset)
        self._balanced_setup(topology, cost, None, overflow, layout, cp_method, attention_backend, seed, budget)
