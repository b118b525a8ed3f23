"""Fixed batches (post-training): one given batch balanced over its mini-batches, DP ranks and micro-batches.

balance.py (`balance_batch`), pack.py (one step of a fixed batch, with rank rules and the pipeline order),
dynamic.py (fixed batches on dynamic CP).
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "balance_batch": "balancer.planning.batch.balance",
    "pipeline_times": "balancer.planning.batch.pack",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
