"""Old flat module paths (``balancer.cost``, ``balancer.sampler``, ...) kept importable after the move to
sub-packages: each old name is the same module object as its new home, so patches and isinstance checks agree."""

from __future__ import annotations

import importlib
import sys

# old name under balancer -> new module path
MOVED = {
    "cost": "balancer.planning.cost",
    "topology": "balancer.planning.topology",
    "metrics": "balancer.planning.metrics",
    "planner": "balancer.planning.planner",
    "exact": "balancer.planning.exact",
    "baseline": "balancer.planning.baseline",
    "sampler": "balancer.training.sampler",
    "collate": "balancer.training.collate",
    "loss": "balancer.training.loss",
    "readers": "balancer.data.readers",
    "tokenize": "balancer.data.tokenize",
    "shards": "balancer.data.shards",
    "dataset": "balancer.data.dataset",
    "traces": "balancer.data.traces",
    "report": "balancer.cli.report",
}
# `balancer.plan` is the planning function; the Plan class lives in balancer.planning.plan.


def install_aliases() -> None:
    """Register every old path in ``sys.modules`` (lazily importing nothing that is not already cheap)."""
    package = sys.modules["balancer"]
    for old, new in MOVED.items():
        module = importlib.import_module(new)
        sys.modules[f"balancer.{old}"] = module
        setattr(package, old, module)
