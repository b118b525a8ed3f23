"""How long do the light `balancer` commands take to start, against `python -c "import torch"`?

Question: `balancer --help`, `balancer plan --help` and `balancer stats LENGTHS` import none of torch, scipy,
pyarrow, datasets or transformers (tests/test_imports.py checks that). What does a start cost then, as a share of
importing torch, which every command paid before? Goal: `balancer --help` <= 0.25x the CPU time of `import torch`.

Method: every command runs in a fresh child process (`python -m balancer ...`, the same code as the console
script); its CPU time (user + system, from the child's rusage) and wall time are taken. The commands run
interleaved, round after round, so a busy spell of a shared machine hits all of them alike; the figure is the median
over --rounds rounds. `python -c pass` is the interpreter's own start (the floor every command pays). LENGTHS is a
.npy file of --documents lengths drawn from the built-in WLB-LLM trace (stats plans them for dp8 and prints the
balance report: start-up plus a small job).

    python benchmarks/import_time.py              # 7 rounds
    python benchmarks/import_time.py --rounds 11

Writes benchmarks/results/import_time.json (regenerate the docs table with `python benchmarks/tables.py`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _render as tb
from _common import write_result  # noqa: E402

from balancer.data.traces import load_trace  # noqa: E402

GOAL = 0.25  # balancer --help CPU time / import torch CPU time


def commands(lengths_file: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "python -c 'import torch'": [py, "-c", "import torch"],
        "python -c 'import balancer'": [py, "-c", "import balancer"],
        "balancer --help": [py, "-m", "balancer", "--help"],
        "balancer plan --help": [py, "-m", "balancer", "plan", "--help"],
        "balancer stats LENGTHS": [py, "-m", "balancer", "stats", str(lengths_file)],
    }


def run_once(argv: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one child process running `argv` to completion (exit 0 required)."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({child.returncode}): {child.stderr.read().decode()[-2000:]}")
    child.stderr.close()
    return usage.ru_utime + usage.ru_stime, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every command (default 7; median reported)")
    parser.add_argument("--documents", type=int, default=20_000, help="documents in LENGTHS (default 20000)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        lengths_file = Path(tmp) / "lengths.npy"
        np.save(lengths_file, rng.choice(load_trace("wlbllm"), size=args.documents))
        cmds = commands(lengths_file)
        for argv_ in cmds.values():  # warm the page cache and .pyc files before timing
            run_once(argv_)
        runs: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "wall": []} for name in cmds}
        for _ in range(args.rounds):
            for name, argv_ in cmds.items():
                cpu, wall = run_once(argv_)
                runs[name]["cpu"].append(round(cpu, 4))
                runs[name]["wall"].append(round(wall, 4))
    torch_cpu = statistics.median(runs["python -c 'import torch'"]["cpu"])
    results = {
        name: {
            "cpu_median": statistics.median(r["cpu"]),
            "wall_median": statistics.median(r["wall"]),
            "cpu_vs_import_torch": statistics.median(r["cpu"]) / torch_cpu,
            "cpu": r["cpu"],
            "wall": r["wall"],
        }
        for name, r in runs.items()
    }
    ratio = results["balancer --help"]["cpu_vs_import_torch"]
    payload = {
        "rounds": args.rounds,
        "documents": args.documents,
        "results": results,
        "goal": {"balancer --help cpu / import torch cpu": GOAL, "ratio": ratio, "met": ratio <= GOAL},
    }
    path = write_result("import_time", payload, clock="wall+process_cpu")
    for name, r in results.items():
        print(f"{name:30s} cpu {r['cpu_median']:.3f} s  wall {r['wall_median']:.3f} s  {r['cpu_vs_import_torch']:.2f}x")
    print(f"balancer --help / import torch (CPU): {ratio:.3f} (goal <= {GOAL}); wrote {path}")
    return 0


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_import_time() -> str:
    data = tb.load("import_time")
    machine = data["machine"]
    rows = [
        [
            f"`{name}`",
            tb.fmt(r["cpu_median"], ".3f"),
            tb.fmt(r["wall_median"], ".3f"),
            tb.fmt(r["cpu_vs_import_torch"], ".2f"),
        ]
        for name, r in data["results"].items()
    ]
    goal = data["goal"]
    rows.append(
        [
            f"goal: `balancer --help` <= {goal['balancer --help cpu / import torch cpu']}x",
            "",
            "",
            f"{goal['ratio']:.2f} ({'met' if goal['met'] else 'missed'})",
        ]
    )
    header = ["command (median of {} rounds)".format(data["rounds"]), "CPU s", "wall s", "CPU / import torch"]
    note = (
        f"\n\n{data['date']}, {machine['cpus']} cores, load average {machine['load_average_start'][0]} at start, "
        f"{machine['load_average_end'][0]} at end, {tb.commit_note(data)}; CPU = user + system time of the child "
        "process."
    )
    return tb.markdown(header, rows) + note


TABLES = {  # docs/ marker name -> the table, from the record
    "import_time": table_import_time,
}


if __name__ == "__main__":
    sys.exit(main())
