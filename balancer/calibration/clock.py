"""Which clock a calibration fits: wall time where the machine was quiet enough, process CPU time otherwise.

Wall time is what training pays, but on a machine shared with other jobs it also counts the time a rank waited for a
core. Process CPU time does not, so it stays close to what the run would take alone; it misses what a rank spends
blocked (waiting for a peer's transfer). Every micro-batch is timed on both clocks, so the choice is made after
timing, from what the run measured:

- `load_per_core`: the 1-minute load average before timing, over the machine's cores (other jobs' demand);
- `wall_over_cpu`: the median over CP-1 micro-batches (no peer to wait for) of min wall / min CPU time: 1.0 when the
  rank had its core to itself, larger when it waited for one.

The machine counts as quiet when `load_per_core <= QUIET_LOAD_PER_CORE` and `wall_over_cpu <= QUIET_WALL_OVER_CPU`.
"""

from __future__ import annotations

import os

import numpy as np

CLOCKS = ("auto", "wall", "cpu")
QUIET_LOAD_PER_CORE = 0.5
QUIET_WALL_OVER_CPU = 1.10


def quietness(samples: list[dict], load_before: tuple[float, float, float], cores: int | None = None) -> dict:
    """The measured facts behind the clock choice (see the module docstring); `cores` defaults to this machine's."""
    cores = int(cores or os.cpu_count() or 1)
    solo = [s for s in samples if int(s["cp"]) == 1] or list(samples)
    ratios = [min(s["wall"]) / max(min(s["cpu"]), 1e-9) for s in solo]
    spreads = [(max(s["wall"]) - min(s["wall"])) / min(s["wall"]) for s in samples if len(s["wall"]) > 1]
    return {
        "cores": cores,
        "load_per_core": float(load_before[0]) / cores,
        "wall_over_cpu": float(np.median(ratios)) if ratios else float("nan"),
        "wall_repeat_spread": float(np.median(spreads)) if spreads else None,
    }


def choose_clock(requested: str, facts: dict) -> tuple[str, str]:
    """(clock, reason): `requested` "wall" or "cpu" is kept (the reason says whether the machine was quiet);
    "auto" picks wall on a quiet machine and CPU time otherwise."""
    if requested not in CLOCKS:
        raise ValueError(f"--clock must be one of {CLOCKS}, got {requested!r}")
    quiet = facts["load_per_core"] <= QUIET_LOAD_PER_CORE and facts["wall_over_cpu"] <= QUIET_WALL_OVER_CPU
    measured = (
        f"load average {facts['load_per_core']:.2f} per core before timing (quiet: <= {QUIET_LOAD_PER_CORE}), "
        f"CP-1 wall/CPU time {facts['wall_over_cpu']:.2f} (quiet: <= {QUIET_WALL_OVER_CPU})"
    )
    if requested == "cpu":
        return "cpu", f"process CPU time as asked (--clock cpu); {measured}"
    if requested == "wall":
        state = "quiet" if quiet else "NOT quiet: other jobs' time is in these timings"
        return "wall", f"wall time as asked (--clock wall); machine {state}: {measured}"
    if quiet:
        return "wall", f"wall time: the machine was quiet ({measured})"
    return "cpu", (
        f"process CPU time: the machine was busy ({measured}); wall time would count the time ranks waited for a "
        "core, CPU time does not (it also leaves out time a rank is blocked on a peer)"
    )
