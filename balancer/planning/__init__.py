"""Planning: the cost model, the topology, the plan data model and the algorithms that fill it (no torch).

Modules, lower ones first: topology.py, cost.py (`CostModel`; fitting.py fits it), metrics.py (section-3 metrics and
the 1F1B formula), predict.py (layout- and communication-aware prediction), plans.py (`Plan`; files in plan_io.py),
units.py / steps.py / binpack.py / polish.py (the planner's stages), planner.py (`plan`), window.py (`plan_window`:
one window of an epoch), dynamic.py (dynamic CP), batch.py / batch_pack.py / batch_dynamic.py (`balance_batch`: one
fixed post-training batch), exact.py (MILP optimum of one step), baseline.py (token-count packing).
"""

from balancer._lazy import lazy_exports

_EXPORTS = {
    "CostModel": "balancer.planning.cost",
    "Topology": "balancer.planning.topology",
    "Plan": "balancer.planning.plans",
    "plan": "balancer.planning.planner",
    "plan_window": "balancer.planning.window",
    "pack_step": "balancer.planning.binpack",
    "predict_plan": "balancer.planning.predict",
    "micro_batch_time": "balancer.planning.predict",
    "micro_batch_times": "balancer.planning.predict",
    "attention_pairs": "balancer.planning.pairs",
    "block_pairs": "balancer.planning.pairs",
    "lower_bound": "balancer.planning.metrics",
    "one_f_one_b": "balancer.planning.metrics",
    "step_times": "balancer.planning.metrics",
    "optimal_step": "balancer.planning.exact",
    "token_count_plan": "balancer.planning.baseline",
    "OVERFLOW_POLICIES": "balancer.planning.units",
    "balance_batch": "balancer.planning.batch",
    "pipeline_times": "balancer.planning.batch_pack",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
