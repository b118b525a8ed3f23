"""Training-loop integration: the balanced sampler, the packed collator, CP process groups and loss normalisation.

Modules: sampler.py (`BalancedBatchSampler`; planning windows in segments.py, resume states in sampler_state.py,
length sources in lengths.py), indices.py (`Span`, `Member`, `CPGroup`, `SpanDataset`), collate.py
(`PackedCollator`), groups.py (`cp_groups`),
loss.py and one rank's micro-batches of a given plan (plan_batches.py). The Hugging Face trainers built on them live
in `balancer.trainers` (imported through `balancer.hf`).
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "BalancedBatchSampler": "balancer.training.sampler",
    "StepInfo": "balancer.training.step_info",
    "PackedCollator": "balancer.training.collate",
    "Span": "balancer.training.indices",
    "SpanDataset": "balancer.training.indices",
    "Member": "balancer.training.indices",
    "Filler": "balancer.training.indices",
    "CPGroup": "balancer.training.indices",
    "cp_groups": "balancer.training.groups",
    "loss": "balancer.training.loss",
    "token_loss": "balancer.training.loss",
    "batch_loss": "balancer.training.loss",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
