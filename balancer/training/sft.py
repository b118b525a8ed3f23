"""TRL's ``SFTTrainer`` on balanced, packed data: TRL prepares the dataset (text or chat -> ``input_ids`` and
``labels`` with the prompt / non-assistant tokens masked), the balanced trainer does the rest (see
``balancer.training.trainer``)."""

from __future__ import annotations

from typing import Optional

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised without trl only
    raise ImportError("balancer.hf.BalancedSFTTrainer needs TRL: pip install 'seqbalancer[trainer]'") from exc

from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.training.trainer import BalancedTrainingMixin, _dataset_for_packing, balanced_args, check_topology


class BalancedSFTTrainer(BalancedTrainingMixin, SFTTrainer):
    """``trl.SFTTrainer`` on balanced, packed data.

    ``train_dataset`` is what SFTTrainer takes (a ``datasets.Dataset`` of text, prompt/completion or chat messages,
    tokenized with ``processing_class``; or already tokenized ``input_ids``). The plan does the packing and decides
    what happens to long documents (``overflow``), so ``SFTConfig`` must have ``packing=False``,
    ``padding_free=False`` and ``max_length=None`` (its default 1024 would truncate every longer document). Other
    arguments as for ``BalancedTrainer``.
    """

    def __init__(
        self,
        model,
        args: Optional[SFTConfig] = None,
        train_dataset=None,
        *,
        topology: Topology,
        cost: Optional[CostModel] = None,
        overflow: str = "error",
        layout: str = "zigzag",
        cp_method: str = "ring",
        attention_backend: str = "auto",
        seed: Optional[int] = None,
        **kwargs,
    ) -> None:
        check_topology(topology)
        if args is None:
            args = SFTConfig(output_dir="trainer_output", max_length=None)
        if not isinstance(args, SFTConfig):
            raise TypeError(f"args must be a trl.SFTConfig, got {type(args).__name__}")
        bad = [f"{k}={getattr(args, k)!r}" for k in ("packing", "padding_free") if getattr(args, k)]
        if args.max_length is not None:
            bad.append(f"max_length={args.max_length}")
        if bad:
            raise ValueError(
                f"SFTConfig({', '.join(bad)}): the balanced trainer packs and plans lengths itself; set packing=False, "
                "padding_free=False and max_length=None (documents longer than topology max_tokens*cp follow "
                "overflow='error'|'split'|'truncate')"
            )
        if kwargs.get("eval_dataset") is not None:
            raise ValueError("eval_dataset is not supported by the balanced trainer: evaluate with a plain Trainer")
        super().__init__(model=model, args=balanced_args(args, topology), train_dataset=train_dataset, **kwargs)
        self.train_dataset = _dataset_for_packing(self.train_dataset)
        self._balanced_setup(topology, cost, None, overflow, layout, cp_method, attention_backend, seed)
