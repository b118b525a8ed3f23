"""Post-training frameworks on balanced micro-batches, one module per framework, each imported explicitly (they
import their framework; ``import balancer`` imports none of them):

- ``balancer.integrations.trl``: TRL's ``GRPOTrainer`` and ``DPOTrainer`` (``BalancedGRPOTrainer``,
  ``BalancedDPOTrainer``), every generation / preference batch packed with ``balancer.balance_batch``;
- ``balancer.integrations.verl``: drop-ins for verl's sequence balancing and dynamic micro-batching on verl's own
  ``DataProto``.

See docs/post-training.md.
"""
