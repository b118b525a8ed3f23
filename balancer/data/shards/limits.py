"""The documented range of every count option of `pretokenize`, `merge` and `pack`, checked before any work starts
(`check_count`: a DataError naming the option, as an argument name on the API and as a flag on the CLI)."""

from __future__ import annotations

import os
from typing import Optional

from balancer.data.shards.errors import DataError, arg

MAX_LENGTH = 2**31 - 1  # tokens in one row: Arrow list offsets are int32
MAX_SHARD_TOKENS = 2**40  # tokens per shard (~2 TB of uint16 ids)
DEFAULT_SHARD_TOKENS = 100_000_000  # a shard closes after this many tokens (~200 MB of uint16 ids)
MAX_NUM_PROC = 1024  # worker processes (clipped further to the CPUs and the records)
MAX_NUM_SHARDS = 2**20  # --num-shards slices
MAX_EPOCHS = 10_000  # pack --epochs
MAX_SEED = 2**63 - 1 - 10_000  # pack --seed: epoch e < MAX_EPOCHS plans with seed + e, an int64
MAX_RANKS = 2**20  # pack --dp, --cp, --pp, --micro-batches (one row per micro-batch and DP rank)
MAX_STEP_TOKENS = 2**62  # pack --tokens-per-step


def check_count(name: str, value: object, low: int, high: int) -> int:
    """`value` when it is an integer in [low, high]; DataError naming the option otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"{arg(name)} must be an integer, got {value!r}")
    if not low <= value <= high:
        shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:12]}...({len(str(value))} digits)"
        raise DataError(f"{arg(name)} must be in [{low}, {high:,}], got {shown}")
    return value


def check_pack_topology(topology) -> None:
    """The topology's counts in the ranges a packed folder can hold: a row is one micro-batch over the CP group, so
    `max_tokens * cp` fits Arrow's int32 list offsets; DataError naming the field (a flag on the CLI)."""
    for name in ("dp", "cp", "pp", "micro_batches"):
        check_count(name, getattr(topology, name), 1, MAX_RANKS)
    check_count("max_tokens", topology.max_tokens, 1, MAX_LENGTH // topology.cp)
    optional_count("tokens_per_step", topology.tokens_per_step, 1, MAX_STEP_TOKENS)


def usable_processes(num_proc: int, records: int, log) -> int:
    """`num_proc` clipped to the CPUs this process may use and the records to encode (more workers only cost
    start-up); `log` gets one line when it was clipped."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    use = max(1, min(num_proc, cpus, records))
    if use < num_proc:
        log(f"using {use} worker process(es) of the {num_proc} asked ({cpus} CPUs, {records} records to encode)")
    return use


def optional_count(name: str, value: Optional[int], low: int, high: int) -> Optional[int]:
    """As `check_count`, None allowed."""
    return None if value is None else check_count(name, value, low, high)
