"""Shared bits of the benchmark scripts: result files, the standard topology rule, machine facts."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

import balancer

RESULTS = Path(__file__).parent / "results"
DEFAULT_COST = balancer.CostModel(attn_coef=2 / 53000, linear_coef=1.0)
TOPOLOGIES = {  # name: (dp, cp, pp, micro_batches)
    "dp8": (8, 1, 1, 4),
    "dp4xcp8": (4, 8, 1, 8),
    "dp4xcp2xpp4": (4, 2, 4, 8),
}


def standard_topology(
    lengths: np.ndarray, dp: int, cp: int, pp: int, m: int, fill: float = 0.85, max_tokens: int | None = None
) -> balancer.Topology:
    """max_tokens = next power of two >= longest document / cp; tokens_per_step = fill x capacity."""
    if max_tokens is None:
        max_tokens = 1 << int(np.ceil(np.log2(-(-int(lengths.max()) // cp))))
    return balancer.Topology(
        dp=dp,
        cp=cp,
        pp=pp,
        micro_batches=m,
        max_tokens=max_tokens,
        tokens_per_step=int(fill * dp * cp * m * max_tokens),
    )


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path
