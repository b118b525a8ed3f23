"""balancer: sequence-length-aware packing and DP x CP x PP scheduling for mixed long/short training data.

Sub-packages by concern: ``balancer.planning`` (cost model, topology, plan, planner, metrics),
``balancer.training`` (sampler, collator, loss), ``balancer.data`` (the shard format, ``pretokenize``, ``pack``,
length traces), ``balancer.calibration`` and ``balancer.cli`` (the ``balancer`` command, thin over the rest). The
names users start from are re-exported here and imported on first use (``import balancer`` imports no torch,
scipy, pyarrow or datasets). Where every public name lives: docs/design.md.
"""

from attention._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "CostModel": "balancer.planning.cost.model",
    "Topology": "balancer.planning.topology",
    "Plan": "balancer.planning.plans.plan",
    "plan": "balancer.planning.planner",
    "plan_window": "balancer.planning.window",
    "balance_batch": "balancer.planning.batch.balance",
    "distributed": "balancer.distributed",
    "BalancedBatchSampler": "balancer.training.sampler",
    "BalancedStream": "balancer.streaming.dataset",
    "BalanceMonitor": "balancer.measured.monitor",
    "PackedCollator": "balancer.training.collate",
    "SpanDataset": "balancer.training.indices",
    "cp_groups": "balancer.training.groups",
    "loss": "balancer.training.loss",
    "ShardDataset": "balancer.data.shards.dataset",
    "read_lengths": "balancer.data.shards.lengths",
}
__all__ = [*_EXPORTS, "__version__"]
# internals that were exported here before the surface was narrowed: the error names their package
_MOVED = {
    "pack_step": "balancer.planning.packing",
    "Span": "balancer.training",
    "Member": "balancer.training",
    "CPGroup": "balancer.training",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _MOVED)
