"""One side of benchmarks/plan_guard.py: plan every shape of a job once (a `plan` shape `best_of` times, its least CPU
kept) with the `balancer` found first on PYTHONPATH (a checkout of the commit under test) and print one JSON line of
process CPU times and plan quality.

Run by plan_guard.py only: `python _guard_worker.py JOB.json ROOT` where ROOT is the checkout whose `balancer` must
be the one imported (refused otherwise, so a side never silently measures the installed package).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _load_balancer(root: Path):
    import balancer

    where = Path(balancer.__file__).resolve()
    if root.resolve() not in where.parents:
        raise SystemExit(f"_guard_worker: imported balancer from {where}, not from {root}")
    return balancer


def _topology(balancer, spec: dict):
    return balancer.Topology(**spec)


def _cost(balancer, spec: dict):
    return balancer.CostModel(attn_coef=spec["attn_coef"], linear_coef=spec["linear_coef"])


def _plan_shape(balancer, shape: dict, data: Path) -> dict:
    lengths = np.load(data / f"{shape['data']}.npy")
    topo, cost = _topology(balancer, shape["topology"]), _cost(balancer, shape["cost"])
    calls, cpu = shape.get("calls", 1), float("inf")
    for _ in range(shape.get("best_of", 1)):  # the least CPU of best_of timings, each the mean of `calls` plans
        t0 = time.process_time()
        for _ in range(calls):
            plan = balancer.plan(lengths, topo, cost, seed=shape.get("seed", 0))
        cpu = min(cpu, (time.process_time() - t0) / calls)
    m = plan.metrics()
    return {
        "cpu_s": cpu,
        "imbalance": m["imbalance"],
        "epoch_efficiency": m["epoch_efficiency"],
        "steps": m["steps"],
    } | {"digest": _digest(plan.doc, plan.start, plan.end, plan.mb_ptr, _natural(plan))}


def _natural(plan) -> np.ndarray:
    """The plan's natural steps (where each document would land without balancing), empty where it has none."""
    return np.zeros(0, dtype=np.int64) if getattr(plan, "natural_step", None) is None else plan.natural_step


def _digest(*arrays: np.ndarray) -> str:
    """SHA-1 of the placements (documents, spans, micro-batch boundaries, natural steps): equal exactly when the
    plans are."""
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def _pack_step_shape(balancer, shape: dict, data: Path) -> dict:
    from balancer.planning.metrics import lower_bound, step_times

    try:
        from balancer.planning.packing import pack_step
    except ImportError:  # commits before the packing package had it in planning.binpack (named, not imported here)
        pack_step = importlib.import_module("balancer.planning.binpack").pack_step

    lengths = np.load(data / f"{shape['data']}.npy")
    topo, cost = _topology(balancer, shape["topology"]), _cost(balancer, shape["cost"])
    c = cost.cost(lengths)
    calls = shape.get("calls", 20)
    t0 = time.process_time()
    for _ in range(calls):
        unit_bin = pack_step(c, lengths, topo)
    cpu = (time.process_time() - t0) / calls
    if np.any(unit_bin < 0):
        raise SystemExit(f"_guard_worker: pack_step left {int(np.sum(unit_bin < 0))} of {len(c)} units unplaced")
    mb = np.bincount(unit_bin, weights=c, minlength=topo.bins_per_step).reshape(1, topo.dp, topo.micro_batches)
    ratio = float(step_times(mb, topo)[0]) / float(lower_bound(c.sum(), c.max(), topo))
    out = {"cpu_s": cpu, "imbalance": float(ratio), "epoch_efficiency": float(1 / ratio), "steps": 1}
    return out | {"digest": _digest(unit_bin)}


def _cli_shape(balancer, shape: dict, data: Path) -> dict:
    from balancer.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        sink = io.StringIO()
        t0 = time.process_time()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            code = main([*shape["argv"], "-o", str(out)])
        cpu = time.process_time() - t0
        if code != 0:
            raise SystemExit(f"_guard_worker: balancer {' '.join(shape['argv'])} exited {code}: {sink.getvalue()}")
        m = balancer.Plan.load(out).metrics()
    return {"cpu_s": cpu, "imbalance": m["imbalance"], "epoch_efficiency": m["epoch_efficiency"], "steps": m["steps"]}


KINDS = {"plan": _plan_shape, "pack_step": _pack_step_shape, "cli": _cli_shape}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    balancer = _load_balancer(Path(sys.argv[2]))
    data = Path(job["data"])
    out = {shape["name"]: KINDS[shape["kind"]](balancer, shape, data) for shape in job["shapes"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
