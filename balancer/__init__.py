"""balancer: sequence-length-aware packing and DP x CP x PP scheduling for mixed long/short training data.

Sub-packages by concern: ``balancer.planning`` (cost model, topology, plan, planner, metrics),
``balancer.training`` (sampler, collator, loss), ``balancer.data`` (the shard format, ``pretokenize``, ``pack``,
length traces), ``balancer.calibration`` and ``balancer.cli`` (the ``balancer`` command, thin over the rest). The
names users start from are re-exported here and imported on first use (``import balancer`` imports no torch,
scipy, pyarrow or datasets). Where every public name lives: docs/design.md.
"""

from balancer._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "CostModel": "balancer.planning.cost.model",
    "Topology": "balancer.planning.topology",
    "Plan": "balancer.planning.plans.plan",
    "plan": "balancer.planning.planner",
    "plan_window": "balancer.planning.window",
    "pack_step": "balancer.planning.packing.step",
    "balance_batch": "balancer.planning.batch.balance",
    "distributed": "balancer.distributed",
    "BalancedBatchSampler": "balancer.training.sampler",
    "PackedCollator": "balancer.training.collate",
    "Span": "balancer.training.indices",
    "SpanDataset": "balancer.training.indices",
    "Member": "balancer.training.indices",
    "CPGroup": "balancer.training.indices",
    "cp_groups": "balancer.training.groups",
    "loss": "balancer.training.loss",
    "ShardDataset": "balancer.data.shards.dataset",
    "read_lengths": "balancer.data.shards.lengths",
}
__all__ = [*_EXPORTS, "__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
