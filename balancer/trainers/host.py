"""The class the Trainer mixins are type-checked against: for the type checker, `transformers.Trainer` with what the
balanced trainer's mixins set up and call of each other; `object` at run time (each mixin is mixed into a Trainer
subclass, whose attributes and hooks it uses and overrides; importing this module imports no transformers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from transformers import Trainer

    from balancer.planning.cost.model import CostModel
    from balancer.planning.topology import Topology
    from balancer.streaming.dataset import BalancedStream
    from balancer.training.collate import PackedCollator
    from balancer.training.sampler import BalancedBatchSampler

    class TrainerHost(Trainer):
        """The stock Trainer plus what the balanced mixins share (set up by BalancedTrainingMixin)."""

        topology: Topology
        cost_model: CostModel
        packed_collator: PackedCollator
        dp_rank: int
        cp_rank: int
        balanced_sampler: Optional[BalancedBatchSampler]
        balanced_stream: Optional[BalancedStream]
        _overflow: str
        _plan_seed: int

        def _layout_context(self, model: Any, inputs: dict) -> AbstractContextManager: ...

        def _balance_source(self) -> Any: ...

else:
    TrainerHost = object

__all__ = ["TrainerHost"]
