"""Packing the units of a step into its `dp * micro_batches` micro-batches so that the replicas' 1F1B times match.

step.py (`pack_step`: one step, heavy units first, water-filling for the rest, a spill rule), epoch.py (every step
of an epoch at once: batched LPT over padded arrays), search.py (local search: moves and swaps off the slowest
replica), settle.py (the epoch in order: keep the batched packing where it is good, re-pack, carry and backfill
where not), refine.py (moves between the replicas of a step), across.py (moves and swaps across nearby steps),
replicas.py (which replica runs which share of a step: a seeded permutation on even ranks), rowops.py (array helpers
of the hot loops).
"""

from attention._lazy import lazy_exports

_EXPORTS = {"pack_step": "balancer.planning.packing.step"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
