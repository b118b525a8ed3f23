"""Megatron-Core on balanced plans (megatron-core 0.19.2, installed by ``tools/setup.sh test``):

- `megatron_batch` (batches.py): one micro-batch in Megatron's packed-sequence contract for this CP rank, in
  Megatron's per-document zigzag (padded to ``2 * cp``), per-sequence zigzag, or the project's no-padding hybrid
  layout; `packed_seq_params` makes its ``PackedSeqParams`` (`BalancedPackedSeqParams`, params.py);
- `BalancedScheduler` (scheduler.py): the plan as Megatron's training loop takes it: per step a data iterator and
  ``num_microbatches``, each micro-batch with its CP group (dynamic CP);
- `CPCoreAttention` (core_attention.py): a core-attention module backed by `attention.cp_attention`.

Imported explicitly (``import balancer`` imports none of it); `megatron_batch` and `BalancedScheduler` need no
megatron-core, the other names import it. See docs/megatron.md.
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "megatron_batch": "balancer.integrations.megatron.batches",
    "packed_seq_params": "balancer.integrations.megatron.batches",
    "BalancedPackedSeqParams": "balancer.integrations.megatron.params",
    "BalancedScheduler": "balancer.integrations.megatron.scheduler",
    "MegatronStep": "balancer.integrations.megatron.scheduler",
    "CPCoreAttention": "balancer.integrations.megatron.core_attention",
    "LAYOUTS": "balancer.integrations.megatron.layouts",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
