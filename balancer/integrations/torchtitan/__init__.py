"""torchtitan on balanced, packed, CP-sharded micro-batches (imports torchtitan; see docs/torchtitan.md).

- `BalancedDataLoader` (loader.py): torchtitan's data loader (`config.dataloader = BalancedDataLoader.Config(...)`);
- `PackedAttention`, `use_packed_attention` (attention.py): the inner attention its models call for packed
  documents, exact under CP;
- `PackedDocuments` (batches.py): what the loader hands that attention;
- `cost_for` (cost.py): the analytic cost model of a torchtitan model config.
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "BalancedDataLoader": "balancer.integrations.torchtitan.loader",
    "PackedAttention": "balancer.integrations.torchtitan.attention",
    "use_packed_attention": "balancer.integrations.torchtitan.attention",
    "PackedDocuments": "balancer.integrations.torchtitan.batches",
    "cost_for": "balancer.integrations.torchtitan.cost",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
