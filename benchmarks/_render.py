"""What the benchmarks' table functions share: cell formatting, markdown, reading a record (the current one, or one
from history as NAME@REV) and the line saying how a record was measured. benchmarks/tables.py renders the tables each
benchmark declares (its module-level TABLES) into docs/."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


LOADED: dict[str, dict] = {}  # every record read by load(), for tables.py's check of what each names


def load(name: str) -> dict:
    """The record benchmarks/results/NAME.json; `NAME@REV`: that file as it was at git revision REV (results/ keeps
    only each benchmark's current record: earlier ones live in git)."""
    if "@" not in name:
        LOADED[name] = json.loads((RESULTS / f"{name}.json").read_text())
        return LOADED[name]
    record, rev = name.split("@", 1)
    done = subprocess.run(
        ["git", "show", f"{rev}:benchmarks/results/{record}.json"], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"record {name}: git show failed: {done.stderr.strip()}")
    LOADED[name] = json.loads(done.stdout)
    return LOADED[name]


def commit_and_load(record: dict) -> tuple[str | None, list | None]:
    """The commit a record was measured at and the machine's load at its start, where it names them (None if not):
    `git.commit` or `commit`, and `machine.load_average_start` or `machine.load_start`."""
    commit = (record.get("git") or {}).get("commit") or record.get("commit")
    machine = record.get("machine") or {}
    return commit, machine.get("load_average_start") or machine.get("load_start")


def fmt(value, spec: str = ".3f") -> str:
    """One cell: numbers formatted, missing values as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def goals_cell(goals: dict) -> str:
    missed = [name for name, met in goals.items() if not met]
    return "missed: " + ", ".join(missed) if missed else "all met"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x + 0.0:.2f}%".replace("-0.00%", "0.00%")  # a rounding-size negative: 0


def measured_on(data: dict) -> str:
    """One line: how a result was measured (clock, repetitions, machine cores and load) from its record."""
    m = data["machine"]
    start, end = m["load_average_start"][0], m["load_average_end"][0]
    reps = data["config"].get("reps")
    return (
        f"Measured {data['date']} UTC on {cores(m)} ({m['processor']}), 1-minute load average {start:.1f} at "
        f"start, {end:.1f} at end; clock: {data['clock']}" + (f"; {reps} repetitions." if reps else ".")
    )


def commit_note(data: dict) -> str:
    """The commit a record names, for a table's measuring line: "commit abc1234" (with "and uncommitted changes" where
    the tree was dirty), or "no recorded commit"."""
    git = data.get("git") or {}
    if not git.get("commit"):
        return "no recorded commit"
    return f"commit {git['commit'][:7]}" + (" and uncommitted changes" if git.get("dirty") else "")


def ratio_spread(ratio: dict) -> str:
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def cores(machine: dict) -> str:
    """ "2 cores", with the CPU's model where the record names it ("2 cores of AMD EPYC")."""
    model = machine.get("cpu_model")
    return f"{machine['cpus']} cores" + (f" of {model}" if model else "")


def machine_line(data: dict) -> str:
    m = data["machine"]
    load_start, load_end = m["load_average_start"][0], m["load_average_end"][0]
    return f"{data['clock']} clock, {cores(m)}, 1-minute load {load_start} at start and {load_end} at end"


def record_line(data: dict) -> str:
    """How a record was measured, from the record: date, clock, cores, load at start and end, command."""
    return f"\n\nMeasured {data['date']} UTC: {machine_line(data)}; `{data['command']}`."


def paired_ratio(run: dict, a: str, b: str) -> dict:
    """From a replay run's `pairs` (benchmarks/replay.py), how much faster `a`'s epoch was than `b`'s on each clock:
    {"wall"|"cpu": {median, min, max, reps, verdict}}, whichever order the pair was stored in (the verdict names the
    faster plan, so it holds either way round)."""
    if f"{a} vs {b}" in run["pairs"]:
        return run["pairs"][f"{a} vs {b}"]
    stored = run["pairs"][f"{b} vs {a}"]
    return {c: {**p, "median": 1 / p["median"], "min": 1 / p["max"], "max": 1 / p["min"]} for c, p in stored.items()}
