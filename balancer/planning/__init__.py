"""Planning: the cost model, the topology, the plan and the algorithms that fill it (no torch).

The epoch, in order: topology.py (`Topology`), units.py (validated lengths cut into the pieces the planner places),
shuffle.py (the epoch's seeded order and its windows), steps.py (units cut into steps by token targets),
packing/ (each step into micro-batches), planner.py (`plan`: the whole epoch; dynamic/ for `Topology(cp_sizes=...)`),
window.py (`plan_window`: one window of an epoch), metrics.py (section-3 metrics and the 1F1B formula). Beside them:
cost/ (`CostModel`, its fit and the layout-aware prediction), plans/ (`Plan`, its files, its checks), batch/
(`balance_batch`: one fixed post-training batch), exact.py (MILP optimum of one step), baseline.py (token-count
packing). The map with a picture: docs/design.md.
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "CostModel": "balancer.planning.cost.model",
    "Topology": "balancer.planning.topology",
    "Plan": "balancer.planning.plans.plan",
    "plan": "balancer.planning.planner",
    "plan_window": "balancer.planning.window",
    "predict_plan": "balancer.planning.cost.predict",
    "micro_batch_time": "balancer.planning.cost.predict",
    "micro_batch_times": "balancer.planning.cost.predict",
    "attention_pairs": "attention.geometry",
    "block_pairs": "attention.geometry",
    "lower_bound": "balancer.planning.metrics",
    "one_f_one_b": "balancer.planning.metrics",
    "step_times": "balancer.planning.metrics",
    "optimal_step": "balancer.planning.exact",
    "token_count_plan": "balancer.planning.baseline",
    "OVERFLOW_POLICIES": "balancer.planning.units",
    "balance_batch": "balancer.planning.batch.balance",
    "pipeline_times": "balancer.planning.batch.pack",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, {"pack_step": "balancer.planning.packing"})
