"""Calibration: time a real model on a grid of packed micro-batches, fit a CostModel, report held-out error.

    from balancer.calibration import calibrate
    result = calibrate(TINY_LLAMA, cp_sizes=(1, 2), budgets=(1024, 2048, 4096))
    result.cost.save("cost.json")

Modules: run.py (`calibrate`), grid.py (the micro-batch grid and fresh micro-batches), split.py (held-out splits
by micro-batch), report.py (fits, held-out and fresh errors, targets), clock.py (wall or CPU time), timing.py (timing
a real model on gloo CP groups). See docs/cost-model.md.
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "calibrate": "balancer.calibration.run",
    "Calibration": "balancer.calibration.run",
    "error_summary": "balancer.calibration.report",
    "TARGETS": "balancer.calibration.report",
    "split_by_micro_batch": "balancer.calibration.split",
    "leaked_compositions": "balancer.calibration.split",
    "choose_clock": "balancer.calibration.clock",
    "TINY_LLAMA": "balancer.calibration.timing",
    "build_model": "balancer.calibration.timing",
    "time_micro_batches": "balancer.calibration.timing",
    "KINDS": "balancer.calibration.grid",
    "calibration_grid": "balancer.calibration.grid",
    "fresh_micro_batches": "balancer.calibration.grid",
    "fresh_budgets": "balancer.calibration.grid",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
