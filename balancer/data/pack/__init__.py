"""`balancer pack`: balanced, pre-packed rows (one per step, micro-batch and DP rank) for any loader.

Modules: build.py (`pack`: the run, resumable), rows.py (planning the epochs and building rows), verify.py
(`verify_packed`: every row against its plan), output.py (the folder's names for the ownership rules).
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "pack": "balancer.data.pack.build",
    "verify_packed": "balancer.data.pack.verify",
    "packed_metrics": "balancer.data.pack.verify",
    "is_packed": "balancer.data.pack.verify",
    "load_packed_manifest": "balancer.data.pack.verify",
    "SourceTokens": "balancer.data.pack.rows",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
