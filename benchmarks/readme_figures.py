"""Re-measure every figure README.md quotes, then regenerate the docs tables from the new records.

`python benchmarks/readme_figures.py` runs, one after the other, each benchmark behind a README claim with the
command that measures it fresh (no record reused: the peers are re-run beside the project), each writing its record
with its commit, clock and the machine's load at start and end (benchmarks/_common.write_result), then
`benchmarks/tables.py`, then writes README.md's generated figures. `--list` prints the claims and commands without
running them; `--only NAME ...` runs those entries. Hours in all on a 2-core machine (the measured-balance and trainer
runs dominate): run it on a quiet one.

Every figure in README.md's Results section sits in a paragraph between `<!-- figure:NAME -->` and
`<!-- /figure:NAME -->` (TEXTS: balance_batch, planner, compare, replay, calibration, dynamic_cp, trainer,
measured_balance) written from the records alone, each figure with its conditions (script, commit, clock, load at
start and end, machine, date): `--render` rewrites them without measuring, `--check` exits 1 when one is out of
date (tests/docs/test_readme_figures.py runs it; tests/docs/test_figure_records.py checks that no figure stands
outside them). A record that names no commit or no load at start is refused, naming the entry that re-measures it.
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

import numpy as np  # noqa: E402
from _render import commit_and_load, cores, load, paired_ratio  # noqa: E402

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
    "calibration": ("the calibrated model's held-out error", ["benchmarks/calibration.py"]),
    "dynamic_cp": ("dynamic CP on a memory-tight heavy-tail pipeline", ["benchmarks/dynamic_cp.py"]),
    "trainer_compare": ("BalancedTrainer against the built-in trainers",
                        ["benchmarks/trainer_compare.py", "--reps", "6"]),
    "measured_balance_interleaved": ("measured balance on uneven and equal ranks",
                                     ["benchmarks/measured_balance.py", "--configs", "uneven,equal", "--windows", "10",
                                      "--interleave", "--pairs", "5", "--output", "measured_balance_interleaved"]),
    "measured_balance_interleaved_cp": ("measured balance at CP 2 and with dynamic CP",
                                        ["benchmarks/measured_balance.py", "--configs", "cp2,dynamic", "--windows",
                                         "10", "--interleave", "--pairs", "3",
                                         "--output", "measured_balance_interleaved_cp"]),
    "compare_peers_seeds": ("the peers' own batches planned as given, 3 seeds, every column re-run",
                            ["benchmarks/compare.py", "--suite", "peers2026", "--seeds", "0,1,2", "--tokens", "50e6"]),
}  # fmt: skip


def conditions(data: dict) -> str:
    """How a record was measured, for a README figure: script, commit, clock, load at start and end, machine, date."""
    script = data["command"].split()[1] if len(data["command"].split()) > 1 else data["command"]
    git = data.get("git") or {}
    commit = (git.get("commit") or data.get("commit") or "no recorded commit")[:7]
    commit += " + uncommitted changes" if git.get("dirty") else ""
    m = data["machine"]
    clock = {"process_cpu": "process CPU", "wall+process_cpu": "wall and process CPU"}.get(data["clock"], data["clock"])
    return (
        f"`{script}` at {commit}, {clock} time, load {m['load_average_start'][0]:g} at start and "
        f"{m['load_average_end'][0]:g} at end on {cores(m)} ({m['processor']}), {data['date'][:10]}"
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


def _replay_ratio(pair: dict, faster: str) -> str:
    """One paired comparison of the replay on one clock: median ratio, the per-repetition spread and what holds."""
    verdict = pair["verdict"]
    holds = (
        "within noise: each faster in some repetition"
        if verdict == "within noise"
        else f"faster in all {pair['reps']} repetitions"
        if verdict == f"{faster} faster"
        else f"slower in all {pair['reps']} repetitions"
    )
    return f"{pair['median']:.2f}x ({pair['min']:.2f}-{pair['max']:.2f}x, {holds})"


def figure_replay() -> str:
    """The replay paragraph: whole epochs trained on real processes in paired repetitions, on each clock what holds
    (faster in every repetition, or within noise) with the spread of the per-repetition ratios."""
    data = load("replay")
    dp2, layout = data["runs"]["dp2"], data["runs"]["layout"]
    rows = dp2["rows"]
    ours, tokens = rows["balancer"], rows["token-count"]
    trl_wall, trl_cpu = (paired_ratio(dp2, "balancer", "trl-bfd")[c] for c in ("wall", "cpu"))
    tc_wall, tc_cpu = (paired_ratio(dp2, "token-count", "trl-bfd")[c] for c in ("wall", "cpu"))
    vs_wall, vs_cpu = (paired_ratio(dp2, "balancer", "token-count")[c] for c in ("wall", "cpu"))
    hy_wall, hy_cpu = (paired_ratio(layout, "balancer+hybrid", "balancer+zigzag")[c] for c in ("wall", "cpu"))
    return (
        f"- Measured, not only predicted (tiny Llama of about 70K parameters, {data['documents']:,} documents): whole "
        f"epochs trained on 2 concurrent replica processes (dp 2, all-reduce and optimizer steps included), "
        f"{dp2['reps']} paired repetitions (a fresh world each, the plans' steps interleaved). By CPU time (each "
        f"step's slowest rank) this planner's epoch was {_replay_ratio(trl_cpu, 'balancer')} faster than with TRL's "
        f"BFD packing on the same documents (predicted {ours['predicted_speedup']:.2f}x); by wall clock "
        f"{_replay_ratio(trl_wall, 'balancer')}, wall time {ours['wall_over_cpu']:.1f}x the CPU time as the "
        f"processes waited for a core. Token-count packing against TRL: {_replay_ratio(tc_cpu, 'token-count')} by "
        f"CPU time (predicted {tokens['predicted_speedup']:.2f}x), {_replay_ratio(tc_wall, 'token-count')} by wall "
        f"clock; this planner against token-count packing: {_replay_ratio(vs_cpu, 'balancer')} by CPU time, "
        f"{_replay_ratio(vs_wall, 'balancer')} by wall clock. The hybrid layout ran the same micro-batches "
        f"{_replay_ratio(hy_cpu, 'balancer+hybrid')} faster than zigzag at CP 2 by CPU time and "
        f"{_replay_ratio(hy_wall, 'balancer+hybrid')} by wall clock (predicted "
        f"{layout['rows']['balancer+hybrid']['predicted_speedup']:.2f}x) ({conditions(data)}; "
        f"[cost-model.md](docs/cost-model.md#predicted-vs-measured-training-the-replay)).\n"
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


def figure_balance_batch() -> str:
    """The post-training line: balance_batch's CPU time on 16K and 128K rollouts over its options, and its distance
    from the bound."""
    data = load("balance_batch_speed")
    rows = data["rows"]

    def spread(rollouts: int) -> str:
        times = [r["after"]["cpu_seconds"] for r in rows if r["rollouts"] == rollouts]
        return f"{min(times):.2f}-{max(times):.2f} s" if len(times) > 1 else f"{times[0]:.2f} s"

    big = [r for r in rows if r["rollouts"] >= 16_384]
    worst = max(r["after"]["imbalance"] for r in big) - 1
    options = sorted({r["option"] for r in big})
    return (
        f"- Post-training batches: `balance_batch` plans 16K GRPO rollouts in {spread(16_384)} and 128K in "
        f"{spread(131_072)} of CPU time (each its best of {data['repeat']} runs; options {', '.join(options)}), "
        f"within {worst:.0e} of the bound ({conditions(data)}; "
        f"[docs/post-training.md](docs/post-training.md#large-batches-benchmarksbalance_batch_speedpy)).\n"
    )


def figure_compare() -> str:
    """The peers on the same documents: rows where the planner is first or tied-first on imbalance, the predicted
    speedups over TRL's packing (largest; smallest on the trace and heavy-tail rows with CP or PP)."""
    data = load("compare")
    rows = data["rows"]
    first = sum(bool(r.get("balancer_first_imbalance")) for r in rows)
    speedups = [r["peers"]["balancer"].get("speedup_vs_trl") or 0.0 for r in rows]
    goal = data["goal"]
    return (
        f"- Against TRL BFD packing, multipack, verl and WLB on the same documents (predicted by the cost model, "
        f"{len(rows)} distribution x topology rows): first or tied-first on imbalance in {first} of {len(rows)} rows; "
        f"predicted speedup over TRL up to {max(speedups):.2f}x, at least {goal['speedup_min']:.2f}x on the "
        f"{goal['speedup_rows']} trace and heavy-tail rows with CP or PP ({conditions(data)}; "
        f"[docs/benchmarks.md](docs/benchmarks.md)).\n"
    )


def figure_calibration() -> str:
    """`balancer calibrate`'s error on fresh micro-batches in each of the record's runs (load, busy loops), and its
    held-out error over the splits, beside the targets."""
    data = load("calibration")
    runs = data["runs"]
    first = next(iter(runs.values()))["report"]
    fresh = "; ".join(
        f"{name} (load {r['load_at_start'][0]:.1f}, {r['busy_loops'] or 'no'} busy loops beside it, the command "
        f"{r['seconds'] / 60:.0f} min): {r['report']['fresh']['median_abs_error']:.1%} median / "
        f"{r['report']['fresh']['p90_abs_error']:.1%} p90"
        for name, r in runs.items()
    )
    medians = [r["report"]["splits"]["median_abs_error"] for r in runs.values()]
    p90s = [r["report"]["splits"]["worst_p90_abs_error"] for r in runs.values()]
    ft, ht = first["fresh_targets"], first["targets"]
    return (
        f"- `balancer calibrate` with its defaults predicts fresh micro-batches (other documents and budgets, timed "
        f"after the fit, {CLOCKS.get(first['clock'], first['clock'])} time): {fresh}; target "
        f"{ft['median_abs_error']:.0%} / {ft['p90_abs_error']:.0%}. Its held-out "
        f"error (split by micro-batch, {first['splits']['count']} splits): {min(medians):.1%}-{max(medians):.1%} "
        f"median, {min(p90s):.1%}-{max(p90s):.1%} worst-split p90 against the {ht['median_abs_error']:.0%} / "
        f"{ht['p90_abs_error']:.0%} held-out targets ({conditions(data)}; "
        f"[cost-model.md](docs/cost-model.md#measured-here)).\n"
    )


CLOCKS = {"cpu": "process CPU", "wall": "wall-clock"}
MIXES = {"sft": "an SFT mix", "longtail": "a long-tail mix"}
BUILTIN = {
    "hf_rebalance": "transformers' `batch_rebalance`",
    "hf_group": "transformers' `group_by_length`",
    "trl_bfd": "TRL's BFD packing",
}


def _trainer_mix(summary: dict, mix: str) -> str:
    """One mix of trainer_compare: speedup over the best built-in on both clocks and the paired repetitions."""
    s = summary[mix]
    wall, cpu = s["paired_wall"], s["paired_cpu"]
    ahead = sum(w > 1 and c > 1 for w, c in zip(wall, cpu))
    best_wall, best_cpu = BUILTIN[s["best_builtin_wall"]], BUILTIN[s["best_builtin_cpu"]]
    cpu_name = "" if best_cpu == best_wall else f" ({best_cpu})"
    return (
        f"{MIXES.get(mix, mix)} {s['speedup_wall']:.2f}x faster by wall clock than the best built-in ({best_wall}) and "
        f"{s['speedup_cpu']:.2f}x by process CPU{cpu_name}, ahead on both clocks in {ahead} of {len(wall)} paired "
        f"repetitions (paired ratios {min(wall):.2f}-{max(wall):.2f}x wall, {min(cpu):.2f}-{max(cpu):.2f}x CPU)"
    )


def figure_trainer(link: bool = True) -> str:
    """BalancedTrainer against the stock trainers, both mixes, both clocks, with its record's conditions (`link`:
    end with the link to docs/choosing.md, as README.md has it)."""
    data = load("trainer_compare")
    mixes = " and ".join(_trainer_mix(data["summary"], m) for m in data["summary"])
    tail = "; [docs/choosing.md](docs/choosing.md#measured-in-the-trainer)" if link else ""
    return (
        f"- In the user's own trainer (2 gloo ranks, a tiny Llama, one epoch): `BalancedTrainer` trained "
        f"{mixes} ({conditions(data)}{tail}).\n"
    )


def figure_peers(link: bool = True) -> str:
    """Against the 2026 built-ins' planners: the whole epoch (one seed; where the peers' columns come from) and the
    peers' own batches planned as given (three seeds, every column re-run; the rows that miss the goal named)."""
    peers, seeds = load("compare_peers"), load("compare_peers_seeds")
    goal, sgoal = peers["goal"], seeds["goal"]
    reused = peers.get("reused")
    source = (
        f"the peers' columns from the run of {reused['date'][:10]} at load "
        f"{reused['machine']['load_average_start'][0]:g}, {', '.join(reused['run_now'])} from this one; "
        if reused
        else "every column from this run; "
    )
    met = sgoal["rows"] - len(sgoal["not_met"])
    missed = f" (missed: {'; '.join(sgoal['not_met'])})" if sgoal["not_met"] else ""
    tail = "; [docs/choosing.md](docs/choosing.md#planner-quality-against-the-2026-peers)" if link else ""
    return (
        f"- Against the 2026 built-ins' planners (transformers, TRL, verl, multipack, WLB): planning the whole epoch "
        f"(documents may move between steps) its excess over the epoch bound is at most {goal['worst_ratio']:.0%} of "
        f"the best peer's on {goal['rows']} rows, one seed ({source}{conditions(peers)}); planning the peers' own "
        f"global batches as given (`balancer_slices`), at most {sgoal['goal_ratio']:.0%} of the best such peer's on "
        f"{met} of {sgoal['rows']} rows over seeds {', '.join(map(str, seeds['config']['seeds']))}{missed}, every "
        f"column re-run ({conditions(seeds)}{tail}).\n"
    )


def figure_measured_balance() -> str:
    """BalanceMonitor(mode="adapt") against the static plan on uneven and equal ranks and with dynamic CP."""
    data, cp = load("measured_balance_interleaved"), load("measured_balance_interleaved_cp")
    conf = {c["config"]: c for c in data["configs"]} | {c["config"]: c for c in cp["configs"]}
    uneven, equal, dynamic = conf["uneven"], conf["equal"], conf["dynamic"]
    attainable = sorted(p["attainable_speedup"] for p in uneven["pairs"] if p.get("attainable_speedup"))
    return (
        f"- Uneven ranks (`Topology(rank_speeds=...)`): work in proportion to each replica's speed, see "
        f'[docs/planner.md](docs/planner.md#uneven-ranks). `BalanceMonitor(mode="adapt")` measures every rank and '
        f"fits the speeds itself: with one rank alone on a core and three sharing the other, "
        f"{uneven['speedup_median']:.2f}x faster than the static plan (median of {len(uneven['pairs'])} "
        f"step-interleaved pairs, every pair at least {uneven['speedup_min']:.2f}x, of an attainable "
        f"{float(np.median(attainable)):.2f}x) and {equal['speedup_median']:.2f}x on equal ranks (median of "
        f"{len(equal['pairs'])}, lowest pair {equal['speedup_min']:.2f}x) ({conditions(data)}); with dynamic CP "
        f"{dynamic['speedup_median']:.2f}x (median of {len(dynamic['pairs'])}, lowest "
        f"{dynamic['speedup_min']:.2f}x; {conditions(cp)}; "
        f"[docs/measured-balance.md](docs/measured-balance.md#measured)).\n"
    )


# README figure marker: (the records it reads, each an entry of FIGURES that re-measures it; the paragraph)
TEXTS: dict[str, tuple[tuple[str, ...], Callable[[], str]]] = {
    "balance_batch": (("balance_batch_speed",), figure_balance_batch),
    "planner": (("planner_quality", "planner_speed", "plan_guard"), figure_planner),
    "compare": (("compare",), figure_compare),
    "replay": (("replay",), figure_replay),
    "calibration": (("calibration",), figure_calibration),
    "dynamic_cp": (("dynamic_cp",), figure_dynamic_cp),
    "trainer": (("trainer_compare",), figure_trainer),
    "peers": (("compare_peers", "compare_peers_seeds"), figure_peers),
    "measured_balance": (("measured_balance_interleaved", "measured_balance_interleaved_cp"), figure_measured_balance),
}
# the same paragraphs on the docs pages the README links to (rendered by benchmarks/tables.py, without the link)
TABLES = {
    "readme_trainer": lambda: wrapped(figure_trainer(link=False)).rstrip("\n"),
    "readme_peers": lambda: wrapped(figure_peers(link=False)).rstrip("\n"),
}
MARKER = re.compile(r"(<!-- figure:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figure:(?P=name) -->)", re.S)


def wrapped(text: str) -> str:
    """Each `- ` item of a generated paragraph wrapped at README.md's 120 columns, continuation lines indented."""
    items = [line for line in text.splitlines() if line]
    fill = [
        textwrap.fill(i, 120, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False) for i in items
    ]
    return "\n".join(fill) + "\n"


def unnamed(records: tuple[str, ...]) -> list[str]:
    """The records among `records` that name no commit or no machine load at start, each with what it lacks."""
    bad = []
    for record in records:
        commit, start_load = commit_and_load(load(record))
        if commit is None or start_load is None:
            bad.append(f"{record} (no {'commit' if commit is None else 'load at start'})")
    return bad


def paragraph(name: str) -> str:
    """The README paragraph `name` from its records; a record that names no commit or load, or whose layout it does
    not know, is one clear error."""
    records, build = TEXTS[name]
    bad = unnamed(records)
    if bad:
        raise SystemExit(
            f"README figure {name!r}: records without their commit or load at start: {', '.join(bad)}; re-measure "
            f"them (python benchmarks/readme_figures.py --only {' '.join(b.split()[0] for b in bad)})"
        )
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
