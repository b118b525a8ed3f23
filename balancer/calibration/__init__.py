"""Calibration: time a real model on a grid of packed micro-batches, fit a CostModel, report held-out error.

    from balancer.calibration import calibrate
    result = calibrate(TINY_LLAMA, cp_sizes=(1, 2), budgets=(1024, 2048, 4096))
    result.cost.save("cost.json")

Modules: run.py (`calibrate`, the held-out report), grid.py (the micro-batch grid), timing.py (timing a real model
on gloo CP groups). See docs/cost-model.md.
"""

from balancer._lazy import lazy_exports

_EXPORTS = {
    "calibrate": "balancer.calibration.run",
    "Calibration": "balancer.calibration.run",
    "error_summary": "balancer.calibration.run",
    "TINY_LLAMA": "balancer.calibration.timing",
    "build_model": "balancer.calibration.timing",
    "time_micro_batches": "balancer.calibration.timing",
    "KINDS": "balancer.calibration.grid",
    "calibration_grid": "balancer.calibration.grid",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
