"""Dynamic CP: in every micro-batch slot the pool of `dp * cp` ranks is cut into CP groups of the sizes in
`Topology.cp_sizes`, giant documents on large groups, short ones on groups of one rank.

plan.py (`plan_dynamic`: balance on large groups, then cut), cuts.py (the group cuts of every micro-batch at once),
group_times.py (layout-aware times of many document groups from per-group sums).
"""

from attention._lazy import lazy_exports

_EXPORTS = {"plan_dynamic": "balancer.planning.dynamic.plan"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
