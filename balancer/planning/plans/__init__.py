"""The plan: what every micro-batch of every step holds, on which ranks, and its files.

plan.py (`Plan`: the flat placement arrays, steps, metrics), files.py (JSON / `.npz` reading and writing, strict
on load; the format is docs/plan-format.md), checks.py (the invariants `Plan.validate` enforces).
"""

from attention._lazy import lazy_exports

_EXPORTS = {"Plan": "balancer.planning.plans.plan"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
