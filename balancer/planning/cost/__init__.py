"""The cost model: how much work a document and a micro-batch are, and how long they take.

model.py (`CostModel`: the formula, presets, `from_model`, files), fit.py (`CostModel.fit` from measured
micro-batches), pairs.py (attention pair counts under causal / sliding-window masks), microbatch.py (what each CP
rank holds and computes under a layout: the terms the fit and the prediction share), predict.py (the time of a
micro-batch and of a whole plan).
"""

from balancer._lazy import lazy_exports

_EXPORTS = {
    "CostModel": "balancer.planning.cost.model",
    "attention_pairs": "balancer.planning.cost.pairs",
    "block_pairs": "balancer.planning.cost.pairs",
    "micro_batch_terms": "balancer.planning.cost.microbatch",
    "micro_batch_time": "balancer.planning.cost.predict",
    "micro_batch_times": "balancer.planning.cost.predict",
    "predict_plan": "balancer.planning.cost.predict",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
