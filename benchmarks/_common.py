"""Shared bits of the benchmark scripts: result files, the standard topology rule, machine facts."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
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


CLOCKS = ("wall", "process_cpu", "wall+process_cpu", "cuda_events", "none")  # "none": the result holds no timings
LOAD_AT_START = os.getloadavg()  # measured when the benchmark imports this module, before any work


def cpu_model() -> str | None:
    """The CPU's model name as the kernel reports it (/proc/cpuinfo), None where it says none: ratios to a baseline
    move with it (a NumPy-heavy plan against a Python-loop greedy gains more on some CPUs than on others)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip() or None
    except OSError:
        pass
    return None


def machine_record() -> dict:
    """The machine as measured now: cores, CPU model, 1/5/15-minute load averages at start (import) and now,
    Python."""
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "load_average_start": [round(x, 2) for x in LOAD_AT_START],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def git_commit() -> dict:
    """The commit the benchmark ran on and whether the working tree had changes (None outside a git checkout).
    Records under benchmarks/results/ do not count as changes: they are what benchmarks write, not what they run, so
    the second of several benchmarks run in a row (`readme_figures.py`) still names a clean commit."""
    root = Path(__file__).resolve().parents[1]
    status = ["git", "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(status, cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


COMMIT_AT_START = git_commit()  # the code the benchmark runs: HEAD when it imports this module, before any work


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a benchmark's torch.distributed rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def planner_takes_rank_speeds() -> bool:
    """Whether this checkout's planner plans uneven ranks (`Topology` has a `rank_speeds` field)."""
    return "rank_speeds" in {f.name for f in dataclasses.fields(balancer.Topology)}


def table(columns: list[str], rows: list[list]) -> dict:
    """A results table as the benchmark itself states it (benchmarks/tables.py renders any `tables` entry)."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"every row needs {len(columns)} cells ({columns})")
    return {"columns": list(columns), "rows": [list(row) for row in rows]}


def write_result(name: str, payload: dict, *, clock: str, model: dict | None = None) -> Path:
    """Write benchmarks/results/NAME.json: the payload plus how it was measured (the clock of its timings, the
    machine with its load measured at start and end, the model where one ran, the command line, the git commit at the
    start, and the one at the end where it differs).
    Nothing in the record is a fixed note: every field comes from this run. A payload may carry `tables`: {title:
    `table(columns, rows)`}, which benchmarks/tables.py renders without knowing the benchmark."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(__file__).resolve().parents[1])
    except ValueError:
        pass
    record = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join(["python", str(script), *sys.argv[1:]]),
        "clock": clock,
        "machine": machine_record(),
        "git": COMMIT_AT_START,
    }
    at_end = git_commit()
    if at_end != COMMIT_AT_START:  # commits landed while it ran (or the tree became clean or dirty): both named
        record["git_at_end"] = at_end
    if model is not None:
        record["model"] = model
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**record, **payload}, indent=1))
    return path


def recorded_runs(names: list[str], configs: tuple, tool: str) -> list[tuple[str, dict, dict, dict]]:
    """(record name, record, configuration, run) of every run of `configs` in the measured_balance.py records
    `names` (benchmarks/results/NAME.json, or NAME@REV: that record as it was at git revision REV), for the offline
    analyses of recorded runs; a record that does not exist ends the program with one line naming it (exit 2)."""
    from _render import load

    out = []
    for name in names:
        if "@" not in name and not (RESULTS / f"{name}.json").is_file():
            print(f"{tool}: {RESULTS / f'{name}.json'} does not exist", file=sys.stderr)
            sys.exit(2)
        try:
            record = load(name)
        except SystemExit as e:
            print(f"{tool}: {e}", file=sys.stderr)
            sys.exit(2)
        out += [(name, record, c, run) for c in record["configs"] if c["config"] in configs for run in c["runs"]]
    return out
