"""The count arguments of `pretokenize`, `merge` and `pack` checked against their documented ranges (the numbers:
`balancer.limits`) before any work starts: `check_count` raises a DataError naming the option, as an argument name
on the API and as a flag on the CLI."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from balancer.planning.topology import Topology

import os
from typing import Optional

from balancer.data.shards.errors import DataError, arg
from balancer.limits import MAX_LENGTH, MAX_RANKS, MAX_STEP_TOKENS, range_error


def check_count(name: str, value: object, low: int, high: int) -> int:
    """`value` when it is an integer in [low, high]; DataError naming the option otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"{arg(name)} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise DataError(range_error(arg(name), value, low, high))
    return value


def check_pack_topology(topology: Topology) -> None:
    """The topology's counts in the ranges a packed folder can hold: a row is one micro-batch over the CP group, so
    `max_tokens * cp` fits Arrow's int32 list offsets; DataError naming the field (a flag on the CLI)."""
    for name in ("dp", "cp", "pp", "micro_batches"):
        check_count(name, getattr(topology, name), 1, MAX_RANKS)
    check_count("max_tokens", topology.max_tokens, 1, MAX_LENGTH // topology.cp)
    optional_count("tokens_per_step", topology.tokens_per_step, 1, MAX_STEP_TOKENS)


def usable_processes(num_proc: int, records: int, log: Callable[[str], object]) -> int:
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
