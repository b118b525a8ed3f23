"""The cost model: how much work a document and a micro-batch are, and how long they take.

model.py (`CostModel`: the formula, presets, `from_model`, files), fit.py (`CostModel.fit` from measured
micro-batches), microbatch.py (what each CP rank holds and computes under a layout, from the chunk geometry of
`attention.geometry`: the terms the fit and the prediction share), hybrid.py (the cost-driven choice of a hybrid
split, handed to the layout as an explicit split), predict.py (the time of a micro-batch and of a whole plan).
Pair counts (`attention_pairs`, `block_pairs`) live with the chunk geometry in `attention.geometry`.
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "CostModel": "balancer.planning.cost.model",
    "attention_pairs": "attention.geometry",
    "block_pairs": "attention.geometry",
    "micro_batch_terms": "balancer.planning.cost.microbatch",
    "hybrid_split": "balancer.planning.cost.hybrid",
    "explicit_layout": "balancer.planning.cost.hybrid",
    "micro_batch_time": "balancer.planning.cost.predict",
    "micro_batch_times": "balancer.planning.cost.predict",
    "predict_plan": "balancer.planning.cost.predict",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
