"""Measured balance: what each rank really spends per micro-batch, gathered every step, reported against the plan's
prediction, and (adapt mode) refitted into the cost model and the replica speeds that plan the next windows.

Modules: source.py (`StepSource`: the Protocol every step source implements, `StepPlace`), monitor.py
(`BalanceMonitor`), batches.py (`BatchSteps`: the monitor on loops planning one fixed batch at a time with
`balance_batch`), streams.py (`StreamSteps`: the monitor on a `BalancedStream`), ledger.py (the gathered
records), refit.py (the fit of the cost model and the speeds, outliers, the held-back check), report.py (the report
dict), plot.py (`plot_report`: the picture).
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "BalanceMonitor": "balancer.measured.monitor",
    "BatchSteps": "balancer.measured.batches",
    "StreamSteps": "balancer.measured.streams",
    "StepSource": "balancer.measured.source",
    "StepPlace": "balancer.planning.schedule",
    "plot_report": "balancer.measured.plot",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
