"""What the torchft tests share: a real torchft Manager of one replica group with torchft's lighthouse in this
process, the corpus lengths and cost model they plan, and benchmarks/faults_run.py (the multi-process runs: the
lighthouse and every replica group as processes on gloo, replicas killed and started again)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import balancer

COST = balancer.CostModel(attn_coef=1.0, linear_coef=64.0)
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def lengths_of(n: int, seed: int = 0, top: int = 300) -> np.ndarray:
    """`n` lognormal document lengths (at most `top`)."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(3.5, 1.0, n).astype(np.int64) + 2, top)


@contextlib.contextmanager
def solo_manager(async_quorum: bool = False) -> Iterator[tuple[Any, Any]]:
    """A real torchft Manager of one replica group with torchft's lighthouse in this process: (manager, its
    process group)."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=lambda s: None,
        state_dict=lambda: {}, replica_id="solo", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lh.address(), use_async_quorum=async_quorum,
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=20),
    )  # fmt: skip
    try:
        yield manager, pg
    finally:
        manager.shutdown(wait=False)
        lh.shutdown()


def faults_run() -> ModuleType:
    """benchmarks/faults_run.py as a module (the benchmark and the tests run the same driver)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("faults_run")
