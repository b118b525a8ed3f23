"""Re-measure every figure README.md quotes, then regenerate the docs tables from the new records.

`python benchmarks/readme_figures.py` runs, one after the other, each benchmark behind a README claim with the
command that measures it fresh (no record reused: the peers are re-run beside the project), each writing its record
with its commit, clock and the machine's load at start and end (benchmarks/_common.write_result), then
`benchmarks/tables.py`, then writes README.md's generated figures. `--list` prints the claims and commands without
running them; `--only NAME ...` runs those entries. Hours in all on a 2-core machine (the measured-balance and trainer
runs dominate): run it on a quiet one.

README.md's figure paragraphs (planner, replay, dynamic CP) sit between `<!-- figure:NAME -->` and
`<!-- /figure:NAME -->` and are written from the records alone, each figure with its conditions (script, commit,
clock, load at start and end, machine, date): `--render` rewrites them without measuring, `--check` exits 1 when one
is out of date (tests/docs/test_readme_figures.py runs it).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
README = ROOT / "README.md"
sys.path.insert(0, str(HERE))

from _render import load  # noqa: E402

# name: (the README claim it backs, the command's arguments after `python`)
FIGURES: dict[str, tuple[str, list[str]]] = {
    "planner_quality": ("planner imbalance on the four traces against a WLB-LLM-style greedy",
                        ["benchmarks/planner_quality.py"]),
    "planner_speed": ("1M-document epochs against the per-document greedy, the sft trace, one global batch",
                      ["benchmarks/planner_speed.py"]),
    "plan_guard": ("the planner against the commit before the fourth wave, the whole `balancer plan sft` commands",
                   ["benchmarks/plan_guard.py", "--against", "6b2c631", "--full"]),
    "balance_batch_speed": ("balance_batch on 16K and 128K GRPO rollouts", ["benchmarks/balance_batch_speed.py"]),
    "compare": ("against TRL BFD, multipack, verl and WLB on the same documents", ["benchmarks/compare.py"]),
    "compare_peers": ("the 2026 built-ins' planners, peers re-run in the same run",
                      ["benchmarks/compare.py", "--suite", "peers2026"]),
    "replay": ("whole epochs measured on 2 replica processes against TRL packing", ["benchmarks/replay.py"]),
    "hybrid_layout": ("the hybrid layout against zigzag at CP 2",
                      ["benchmarks/hybrid_layout.py", "--reps", "3", "--sweep-batches", "few_long"]),
    "calibration": ("the calibrated model's held-out error", ["benchmarks/calibration.py"]),
    "dynamic_cp": ("dynamic CP on a memory-tight heavy-tail pipeline", ["benchmarks/dynamic_cp.py"]),
    "trainer_compare": ("BalancedTrainer against the built-in trainers",
                        ["benchmarks/trainer_compare.py", "--reps", "6"]),
    "measured_balance_interleaved": ("measured balance on uneven and equal ranks",
                                     ["benchmarks/measured_balance.py", "--configs", "uneven,equal", "--windows", "10",
                                      "--interleave", "--pairs", "5", "--output", "measured_balance_interleaved"]),
    "measured_balance_dynamic": ("measured balance with dynamic CP",
                                 ["benchmarks/measured_balance.py", "--configs", "dynamic", "--pairs", "5",
                                  "--output", "measured_balance_dynamic"]),
}  # fmt: skip


def conditions(data: dict) -> str:
    """How a record was measured, for a README figure: script, commit, clock, load at start and end, machine, date."""
    script = data["command"].split()[1] if len(data["command"].split()) > 1 else data["command"]
    git = data.get("git") or {}
    commit = git["commit"][:7] if git.get("commit") else "no recorded commit"
    commit += " + uncommitted changes" if git.get("dirty") else ""
    m = data["machine"]
    clock = {"process_cpu": "process CPU", "wall+process_cpu": "wall and process CPU"}.get(data["clock"], data["clock"])
    return (
        f"`{script}` at {commit}, {clock} time, load {m['load_average_start'][0]:g} at start and "
        f"{m['load_average_end'][0]:g} at end on {m['cpus']} {m['processor']} cores, {data['date'][:10]}"
    )


def figure_planner() -> str:
    """The planner paragraph: quality against the greedy, speed at 1M documents (two shapes), the whole command
    against the commit before the fourth wave; one figure per claim, each with its record's conditions."""
    quality, speed, guard = load("planner_quality"), load("planner_speed"), load("plan_guard")
    rows = quality["rows"]
    worst = max(r["balancer"]["imbalance"] for r in rows)
    greedy = min(r["wlb"]["imbalance"] for r in rows)
    wlb = next(r for r in speed["rows"] if r["documents"] == 1_000_000)
    sft = speed["many_small_steps"]
    sft_shape = sft["dp4xcp2xM4x2048"]
    old = next(a for a in guard["against"] if a["ref"] == "6b2c631")
    cli = {r["shape"]: r["ratio_median"] for r in old["rows"]}
    return (
        f"- Planner quality: worst `imbalance` {worst:.3f} over the {len(rows)} trace x topology rows (four traces, "
        f"dp8, dp4 x cp8, dp4 x cp2 x pp4), where a WLB-LLM-style greedy's best row is {greedy:.3f} "
        f"({conditions(quality)}).\n"
        f"- Planner speed: 1M WLB-LLM documents on dp64 x cp4 x M8 planned in {wlb['balancer_s']:.2f} s, "
        f"{1 / wlb['speedup']:.3f}x the WLB-style greedy's time in the same run; 1M SFT-like documents on "
        f"dp4 x cp2 x M4 x 2,048 ({sft_shape['steps']:,} steps) in {sft_shape['cpu_s']:.2f} s, "
        f"{sft['vs_greedy']:.3f}x a per-document greedy's ({conditions(speed)}).\n"
        f"- The whole `balancer plan sft --dp 4 --cp 2` command: {cli['cli_sft_dp4cp2']:.2f}x the time of the planner "
        f"at {old['commit'][:7]} (before the fourth wave's quality passes) measured beside it, "
        f"{cli['cli_sft_dp4cp2pp4']:.2f}x with `--pp 4` (median of {guard['reps']} alternating repetitions; "
        f"{conditions(guard)}); see [docs/planner.md](docs/planner.md#speed).\n"
    )


def figure_replay() -> str:
    """The replay paragraph: whole epochs trained on real processes, by wall clock and by CPU time."""
    data = load("replay")
    dp2, layout = data["runs"]["dp2"], data["runs"]["layout"]
    ours, hybrid = dp2["rows"]["balancer"], layout["rows"]["balancer+hybrid"]
    tokens = dp2["rows"]["token-count"]
    for run, row in (
        (dp2, ours),
        (dp2, tokens),
        (layout, hybrid),
    ):  # the speedups on both clocks, from the epochs themselves
        base = run["rows"][run["baseline"]]
        for clock in ("wall", "cpu"):
            row[f"measured_speedup_{clock}"] = base[f"epoch_{clock}_seconds"] / row[f"epoch_{clock}_seconds"]
    return (
        f"- Measured, not only predicted (tiny Llama of about 70K parameters, {data['documents']:,} documents): whole "
        f"epochs trained on 2 concurrent replica processes (dp 2, all-reduce and optimizer steps included) took "
        f"{ours['measured_speedup_wall']:.2f}x less wall-clock time with this planner than with TRL's BFD packing on "
        f"the same documents and {ours['measured_speedup_cpu']:.2f}x less CPU time (each step's slowest rank; "
        f"predicted {ours['predicted_speedup']:.2f}x), with wall time {ours['wall_over_cpu']:.1f}x the CPU time as "
        f"the processes waited for a core; token-count packing, in the same run, "
        f"{tokens['measured_speedup_wall']:.2f}x by wall clock and {tokens['measured_speedup_cpu']:.2f}x by CPU time "
        f"(predicted {tokens['predicted_speedup']:.2f}x; measured ranking by CPU time: "
        f"{', '.join(dp2['ranking_measured'])}); the hybrid layout ran the same micro-batches "
        f"{hybrid['measured_speedup_wall']:.2f}x faster than zigzag at CP 2 by wall clock and "
        f"{hybrid['measured_speedup_cpu']:.2f}x by CPU time (predicted {hybrid['predicted_speedup']:.2f}x) "
        f"({conditions(data)}; [cost-model.md](docs/cost-model.md#predicted-vs-measured-training-the-replay)).\n"
    )


def figure_dynamic_cp() -> str:
    """The dynamic CP line: epoch efficiency of the memory-tight heavy-tail pipeline, fixed groups and dynamic."""
    data = load("dynamic_cp")
    row = next(r for r in data["rows"] if (r["distribution"], r["topology"]) == ("heavy", "dp4xcp2xpp4-tight"))
    static, dynamic = row["static"]["epoch_efficiency"], row["dynamic"]["epoch_efficiency"]
    return (
        f"- Dynamic CP lifts a memory-tight heavy-tail pipeline (dp4 x cp2 x pp4) from {static:.3f} "
        f"to {dynamic:.3f} epoch efficiency ({conditions(data)}; "
        f"[docs/dynamic-cp.md](docs/dynamic-cp.md)).\n"
    )


# README figure marker: (the records it reads, each an entry of FIGURES that re-measures it; the paragraph)
TEXTS: dict[str, tuple[tuple[str, ...], Callable[[], str]]] = {
    "planner": (("planner_quality", "planner_speed", "plan_guard"), figure_planner),
    "replay": (("replay",), figure_replay),
    "dynamic_cp": (("dynamic_cp",), figure_dynamic_cp),
}
MARKER = re.compile(r"(<!-- figure:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figure:(?P=name) -->)", re.S)


def wrapped(text: str) -> str:
    """Each `- ` item of a generated paragraph wrapped at README.md's 120 columns, continuation lines indented."""
    items = [line for line in text.splitlines() if line]
    fill = [
        textwrap.fill(i, 120, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False) for i in items
    ]
    return "\n".join(fill) + "\n"


def paragraph(name: str) -> str:
    """The README paragraph `name` from its records; a record whose layout it does not know is one clear error."""
    records, build = TEXTS[name]
    try:
        return build()
    except (KeyError, StopIteration, TypeError) as e:
        raise SystemExit(
            f"README figure {name!r}: the records {', '.join(records)} lack what it quotes ({type(e).__name__}: {e}); "
            f"update figure_{name} in benchmarks/readme_figures.py to the records' layout"
        ) from e


def render_readme(check: bool) -> int:
    """Rewrite README.md's generated figures from the records (check: exit status 1 when one is out of date)."""
    page = README.read_text()
    found = {m.group("name") for m in MARKER.finditer(page)}
    if found != set(TEXTS):
        raise SystemExit(f"README.md: figure markers {sorted(found)}, expected {sorted(TEXTS)}")
    fresh = MARKER.sub(lambda m: m.group(1) + wrapped(paragraph(m.group("name"))) + m.group(4), page)
    if fresh == page:
        return 0
    if check:
        print("README.md is out of date: run python benchmarks/readme_figures.py --render", file=sys.stderr)
        return 1
    README.write_text(fresh)
    print(f"wrote {README}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the claims and their commands, run nothing")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these entries (of {', '.join(FIGURES)})")
    ap.add_argument("--render", action="store_true", help="rewrite README.md's generated figures, measure nothing")
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's generated figures are out of date")
    args = ap.parse_args()
    if args.render or args.check:
        return render_readme(check=args.check)
    names = args.only or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        ap.error(f"--only: unknown {unknown}; known: {list(FIGURES)}")
    for name in names:
        claim, command = FIGURES[name]
        print(f"{name}: {claim}\n    python {' '.join(command)}", flush=True)
        if args.list:
            continue
        started = time.perf_counter()
        done = subprocess.run([sys.executable, *command], cwd=ROOT)
        if done.returncode not in (0, 1):  # 1: a benchmark that ran and reports a missed goal or a failed guard
            print(f"readme_figures: {name} failed (exit {done.returncode})", file=sys.stderr)
            return done.returncode
        print(f"    done in {time.perf_counter() - started:.0f} s (exit {done.returncode})", flush=True)
    if args.list:
        return 0
    done = subprocess.run([sys.executable, "benchmarks/tables.py"], cwd=ROOT).returncode
    return done or render_readme(check=False)


if __name__ == "__main__":
    sys.exit(main())
