"""Generate the benchmark tables of docs/*.md from benchmarks/results/*.json.

Every figure table in docs/ sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` and is written from
the result JSON alone (a table may appear on several pages): NAME ``RESULT.KEY`` is the table a benchmark stated
itself (``tables[KEY]`` of ``results/RESULT.json``, written with ``_common.table(columns, rows)``, followed by the
record's measuring line); any other NAME is a function registered here for the records written before benchmarks
stated their tables.
``python benchmarks/tables.py`` rewrites the pages; ``--check`` exits 1 if one is out of date (the test suite runs
it), so no figure is pasted by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"


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


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def goals_cell(goals: dict) -> str:
    missed = [name for name, met in goals.items() if not met]
    return "missed: " + ", ".join(missed) if missed else "all met"


def planner_quality() -> str:
    data = load("planner_quality")
    rows = []
    for row in data["rows"]:
        ours, wlb = row["balancer"], row["wlb"]
        rows.append(
            [
                row["distribution"],
                row["topology"],
                fmt(ours["imbalance"], ".4f"),
                fmt(wlb["imbalance"], ".4f"),
                fmt(ours["epoch_efficiency"], ".4f"),
                fmt(wlb["epoch_efficiency"], ".4f"),
                fmt(ours["worst_step"]),
                fmt(wlb["worst_step"]),
                fmt(ours["mean_delay_steps"], ".2f"),
                fmt(row["before"]["epoch_efficiency"], ".4f") if "before" in row else "",
                "all met"
                if all(row["goals"].values())
                else "missed: " + ", ".join(k for k, v in row["goals"].items() if not v),
            ]
        )
    header = [
        "distribution",
        "topology",
        "imbalance",
        "WLB imbalance",
        "epoch efficiency",
        "WLB efficiency",
        "worst step",
        "WLB worst step",
        "delay (steps)",
        "efficiency before",
        "goals",
    ]
    if not any("before" in row for row in data["rows"]):  # run without --before: no such column
        header.pop(-2)
        rows = [row[:-2] + row[-1:] for row in rows]
    return markdown(header, rows)


def planner_speed() -> str:
    data = load("planner_speed")
    clock = "process CPU" if data.get("clock") == "process_cpu" else data.get("clock", "wall")
    load_avg = data.get("machine", {})
    rows = [
        [
            f"{r['documents']:,}",
            f"{r['balancer_s']:.3f} s",
            f"{r['wlb_s']:.3f} s",
            f"{r['speedup']:.1f}x",
            f"{r['balancer_s'] / r['wlb_s']:.3f}x",
            str(r["steps"]),
        ]
        for r in data["rows"]
    ]
    table = markdown(["documents", "balancer", "WLB-style greedy", "speedup", "balancer / greedy", "steps"], rows)
    out = f"dp64 x cp4 x M8 x 32,768, WLB-LLM lengths, {clock} time (best of 3):\n\n{table}"
    out += f"\n\nTime grows {data['growth']:.1f}x for {data['size_ratio']:.0f}x the documents."
    many = data.get("many_small_steps")
    if many:
        small, large = many["dp4xcp2xM4x2048"], many["dp64xcp4xM8x32768"]
        rows = [
            [
                "dp4 x cp2 x M4 x 2,048",
                str(small["steps"]),
                f"{small['cpu_s']:.2f} s",
                fmt(small["epoch_efficiency"], ".4f"),
            ],
            [
                "dp64 x cp4 x M8 x 32,768",
                str(large["steps"]),
                f"{large['cpu_s']:.2f} s",
                fmt(large["epoch_efficiency"], ".4f"),
            ],
            [
                "dp4 x cp2 x M4 x 2,048, per-document cost greedy",
                "",
                f"{many['greedy_cpu_s']:.2f} s",
                fmt(many["greedy_epoch_efficiency"], ".4f"),
            ],
        ]
        out += (
            f"\n\n{many['documents']:,} SFT-like documents ({many['lengths']}), {clock} time:\n\n"
            + markdown(["topology", "steps", "plan time", "epoch efficiency"], rows)
            + f"\n\nMany small steps take {many['vs_greedy']:.3f}x the greedy's time (goal <= 0.08x) and "
            f"{many['vs_few_steps']:.2f}x the few-steps topology's (goal <= 3x): {goals_cell(many['goals'])}."
        )
    if data.get("sft_trace"):
        rows = [
            [r["topology"], str(r["steps"]), f"{r['cpu_s']:.2f} s", fmt(r["epoch_efficiency"], ".4f")]
            for r in data["sft_trace"]
        ]
        out += (
            f"\n\nThe built-in `sft` trace ({data['sft_trace'][0]['documents']:,} documents), llama3-8b cost, "
            f"{clock} time:\n\n" + markdown(["topology", "steps", "plan time", "epoch efficiency"], rows)
        )
    if data.get("one_step"):
        rows = [[r["case"], f"{r['ms']:.2f} ms"] for r in data["one_step"]]
        out += "\n\nOne step (mean of 20 calls, best of 5):\n\n" + markdown(["call", "time"], rows)
    if load_avg.get("load_average_start"):
        out += (
            f"\n\nMachine: {load_avg.get('cpus')} cores, load average (1/5/15 min) "
            f"{load_avg['load_average_start']} at start, {load_avg['load_average_end']} at end."
        )
    return out


def compare_speedup() -> str:
    data = load("compare")
    peers = ["multipack", "verl", "wlb", "balancer"]
    rows = []
    for row in data["rows"]:
        cells = []
        for peer in peers:
            result = row["peers"][peer]
            speedup = result.get("speedup_vs_trl")
            cells.append(f"{speedup:.2f}x" if speedup else str(result.get("status", "-"))[:20])
        first = f"{fmt(row.get('balancer_first_imbalance'))} / {fmt(row.get('balancer_first_efficiency'))}"
        rows.append([row["distribution"], row["topology"], *cells, f"{fmt(row.get('speedup_bound'), '.2f')}x", first])
    header = ["distribution", "topology", *[f"{p} speedup" for p in peers], "bound", "balancer first (imb / eff)"]
    return markdown(header, rows) + _record_line(data)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x + 0.0:.2f}%".replace("-0.00%", "0.00%")  # a rounding-size negative: 0


def compare_peers() -> str:
    """The 2026 suite: every peer's excess over the epoch bound, the project's, its per-step bound, the ratios."""
    data = load("compare_peers")
    project = ("balancer", "balancer_slices")
    names = [p for p in data["rows"][0]["peers"] if p not in project]
    rows = []
    for row in data["rows"]:
        cells = []
        for p in names:
            rec = row["peers"][p]
            cell = _pct(rec.get("excess_epoch")) if rec.get("status") == "ok" else str(rec.get("status"))[:24]
            if rec.get("notes", {}).get("over_cap_micro_batches"):
                cell += "*"
            cells.append(f"**{cell}**" if p == row.get("best_peer") else cell)
        ratio = "-" if row.get("ratio") is None else f"{row['ratio']:.0%}"
        sratio = "-" if row.get("slices_ratio") is None else f"{row['slices_ratio']:.0%}"
        rows.append([row["distribution"], row["topology"], *cells, _pct(row["peers"]["balancer"].get("excess_epoch")),
                     _pct(row.get("step_bound_excess")), ratio,
                     _pct(row["peers"]["balancer_slices"].get("excess_epoch")), sratio])  # fmt: skip
    header = ["distribution", "topology", *names, "balancer", "of it: per-step bound", "balancer / best peer",
              "balancer_slices", "slices / best slice peer"]  # fmt: skip
    goal = data["goal"]
    verdict = f"met on all {goal['rows']}" if goal["met_all"] else f"missed on {len(goal['not_met'])} of {goal['rows']}"
    note = (
        f"\n\nGoal (balancer's excess <= {goal['goal_ratio']:.0%} of the best peer's on every row): {verdict} rows"
        f"; nothing dropped by any valid plan: {fmt(goal['zero_drop_all'])}. * = the plan has micro-batches above "
        "max_tokens (the peer takes no token cap, or needs more than M micro-batches to keep it)."
    )
    reused = data.get("reused")
    if reused:  # the peers' columns come from an earlier run of the same documents (compare.py --peers)
        la = reused["machine"]["load_average_start"][0], reused["machine"]["load_average_end"][0]
        note += (
            f"\n\nColumns {', '.join(reused['peers'])} come from the run of {reused['date']} UTC "
            f"(`{reused['command']}`, 1-minute load {la[0]} at start and {la[1]} at end) on the same documents, "
            f"seed and topologies; {', '.join(reused['run_now'])} from this run:"
        )
    return markdown(header, rows) + note + _record_line(data)


def trainer_compare() -> str:
    """BalancedTrainer against the built-in trainers: measured time, throughput, padding, loss."""
    data = load("trainer_compare")
    rows = []
    for mix, s in data["summary"].items():
        b = s["contenders"]["balancer"]
        for name, r in s["contenders"].items():
            rows.append([mix, name, fmt(r["steps"], "d"), " / ".join(f"{x:.1f}" for x in r["wall_all"]),
                         " / ".join(f"{x:.1f}" for x in r["cpu_all"]), f"{r['tokens_per_second']:,.0f}",
                         f"{r['padding_share']:.1%}", f"{r['heldout_loss']:.4f}",
                         f"{r['wall_seconds'] / b['wall_seconds']:.2f}x",
                         f"{r['cpu_seconds'] / b['cpu_seconds']:.2f}x"])  # fmt: skip
    header = ["mix", "trainer", "steps", "wall s (reps)", "CPU s (reps)", "tokens/s (wall)", "padding",
              "held-out loss", "time / balancer (wall)", "time / balancer (CPU)"]  # fmt: skip
    notes = []
    for mix, s in data["summary"].items():
        lo, hi = s["stock_spread"]
        inside = [c for c, ok in s["loss_within_spread"].items() if ok]
        notes.append(
            f"{mix}: balancer {s['speedup_wall']:.2f}x the best built-in by wall clock ({s['best_builtin_wall']}), "
            f"{s['speedup_cpu']:.2f}x by CPU ({s['best_builtin_cpu']}), goal {s['goal_speedup']}x "
            f"{'met' if s['goal_met'] else 'missed'}; stock batch_rebalance over {len(s['stock_seed_losses'])} seeds: "
            f"held-out loss {lo:.4f}-{hi:.4f} (inside: {', '.join(inside) or 'none'})"
        )
    return markdown(header, rows) + "\n\n" + ".\n".join(notes) + "." + _record_line(data)


def compare_all() -> str:
    data = load("compare")
    rows = []
    for row in data["rows"]:
        for peer, result in row["peers"].items():
            rows.append(
                [
                    row["distribution"],
                    row["topology"],
                    peer,
                    fmt(result.get("imbalance"), ".4f"),
                    fmt(result.get("epoch_efficiency"), ".4f"),
                    fmt(result.get("worst_step")),
                    fmt(result.get("steps"), "d"),
                    fmt(result.get("dropped_tokens"), "d"),
                    fmt(result.get("plan_seconds"), ".2f"),
                ]
            )
    header = [
        "distribution",
        "topology",
        "planner",
        "imbalance",
        "epoch eff.",
        "worst step",
        "steps",
        "dropped",
        "plan s",
    ]
    return markdown(header, rows)


def cp_attention_cpu() -> str:
    data = load("cp_attention_cpu")
    cfg = data["config"]
    keys = [k for k in data if k.endswith("_efficiency")]
    rows = [[k.removesuffix("_efficiency").replace("_", " "), fmt(data[k])] for k in keys]
    rows.append(["attention kernel vs matmul (GFLOP/s ratio)", fmt(data.get("attention_vs_matmul"))])
    note = (
        f"{cfg['world']} gloo ranks x {cfg['threads_per_rank']} thread, {cfg['num_docs']} documents / "
        f"{cfg['tokens']:,} tokens (longest {cfg['max_doc']:,}), {cfg['heads']} heads ({cfg['kv_heads']} KV) x "
        f"{cfg['head_dim']}, {cfg['dtype']}, {cfg['layout']} layout. " + _measured_on(data)
    )
    return note + "\n\n" + markdown(["schedule", "parallel efficiency"], rows)


def pretokenize_throughput() -> str:
    data = load("pretokenize_throughput")
    rows = []
    for run in data["runs"]:
        for name, result in run.items():
            if not isinstance(result, dict) or "mb_per_s" not in result:
                continue
            rows.append(
                [
                    run["tokenizer"],
                    name,
                    fmt(result["mb_per_s"], ".1f"),
                    fmt(result.get("cpu_seconds"), ".2f"),
                    fmt(result.get("overhead_vs_direct"), "+.0%") if "overhead_vs_direct" in result else "-",
                    fmt(result.get("peak_rss_mib"), ".0f"),
                ]
            )
    header = ["tokenizer", "run", "MB/s", "CPU s", "wall overhead", "peak RSS MiB"]
    return markdown(header, rows) + _record_line(data)


def pack_throughput() -> str:
    data = load("pack_throughput")
    rows = []
    for size in data["sizes"]:
        pack, pretok = size["pack"], size["pretokenize"]
        rows.append(
            [
                f"{size['tokens']:,}",
                fmt(pretok["mb_per_s"], ".1f"),
                fmt(pack["mb_per_s"], ".1f"),
                ", ".join(fmt(r, ".2f") for r in size["ratio_per_repeat"]),
                fmt(size["pack_vs_pretokenize_bytes_per_cpu_s"], ".2f"),
                fmt(pack["peak_rss_mib"] - pack["rss_after_imports_mib"], ".0f"),
                "-".join(fmt(f(sample[0] for sample in size["loadavg"]), ".0f") for f in (min, max)),
            ]
        )
    header = ["tokens", "pretokenize MB/s", "pack MB/s", "pack/pretokenize per repeat", "per CPU s"]
    header += ["pack peak MiB above imports", "load avg (1 min)"]
    return markdown(header, rows) + _record_line(data)


def dynamic_cp() -> str:
    data = load("dynamic_cp")
    rows = []
    for row in data["rows"]:
        static, dynamic = row["static"], row["dynamic"]
        rows.append(
            [
                row["distribution"],
                row["topology"],
                ",".join(str(size) for size in row["cp_sizes"]),
                fmt(static["epoch_efficiency"], ".4f"),
                fmt(dynamic["epoch_efficiency"], ".4f"),
                fmt(static["imbalance"], ".4f"),
                fmt(dynamic["imbalance"], ".4f"),
                fmt(dynamic["plan_cpu_seconds"] / max(static["plan_cpu_seconds"], 1e-9), ".1f") + "x",
                goals_cell(row.get("goals", {})),
            ]
        )
    header = ["distribution", "topology", "cp sizes", "static eff.", "dynamic eff.", "static imb.", "dynamic imb."]
    header += ["plan CPU time dyn/static", "goals"]
    return markdown(header, rows)


def dynamic_cp_communication() -> str:
    data = load("dynamic_cp")
    rows = [
        [
            row["distribution"],
            row["topology"],
            ",".join(str(size) for size in row["cp_sizes"]),
            fmt(row["predicted_speedup"], ".3f") + "x",
            fmt(row["rank_slots_on_groups_of_1"], ".2f"),
            fmt(row["plan_cpu_seconds"]["dynamic"] / max(row["plan_cpu_seconds"]["static"], 1e-9), ".1f") + "x",
            goals_cell(row["goals"]) if "goals" in row else "",
        ]
        for row in data["communication_rows"]
    ]
    header = ["distribution", "topology", "cp sizes", "predicted speedup", "share of rank-slots in groups of 1"]
    return markdown(header + ["plan CPU time dyn/static", "goals"], rows)


def _measured_on(data: dict) -> str:
    """One line: how a result was measured (clock, repetitions, machine cores and load) from its record."""
    m = data["machine"]
    start, end = m["load_average_start"][0], m["load_average_end"][0]
    reps = data["config"].get("reps")
    return (
        f"Measured {data['date']} UTC on {m['cpus']} cores ({m['processor']}), 1-minute load average {start:.1f} at "
        f"start, {end:.1f} at end; clock: {data['clock']}" + (f"; {reps} repetitions." if reps else ".")
    )


def _spread(ratio: dict) -> str:
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def hybrid_layout(name: str = "hybrid_layout") -> str:
    data = load(name)
    rows = []
    for name, ratio in data["ratios_zigzag_over_hybrid"].items():
        batch, method = name.split("/")
        chosen = ratio.get("with_cost") or {}
        rows.append(
            [
                batch,
                method,
                f"{ratio['zigzag_bytes'] / 2**20:,.0f}",
                f"{ratio['hybrid_bytes'] / 2**20:,.0f}",
                str(ratio["hybrid_split_docs"]),
                _spread(ratio["speedup_cpu"]),
                _spread(ratio["speedup_wall"]),
                fmt(ratio["predicted_speedup"], ".2f") + "x",
                str(chosen["split_docs"]) if chosen else "-",
                _spread(chosen["speedup_cpu"]) if chosen else "-",
                fmt(chosen.get("predicted_speedup"), ".2f") + ("x" if chosen else ""),
            ]
        )
    header = ["micro-batch", "method", "zigzag MiB sent", "hybrid MiB sent", "hybrid split docs"]
    header += ["speedup (CPU time)", "speedup (wall)", "predicted speedup", "with cost: split docs"]
    header += ["with cost: speedup (CPU time)", "with cost: predicted"]
    return _measured_on(data) + "\n\n" + markdown(header, rows)


def hybrid_layout_runs() -> str:
    data = load("hybrid_layout")
    rows = []
    for run in data["rows"]:
        options = {k: v for k, v in run["layout"].items() if k != "kind"}
        labels = [("cost=calibrated" if k == "cost" else f"{k}={v}") for k, v in options.items() if v is not None]
        label = run["layout"]["kind"] + (f" ({', '.join(labels)})" if labels else "")
        rows.append(
            [
                run["batch"],
                run["method"],
                label,
                fmt(run["fwd_bwd_cpu_s"], ".2f"),
                fmt(run["fwd_bwd_s"], ".2f"),
                fmt(run["predicted_s"], ".2f"),
                fmt(sum(run["bytes_per_rank"]) / 1e6, ".1f"),
                str(run["split_docs"]),
                fmt(run["relative_load"]),
            ]
        )
    header = ["micro-batch", "method", "layout", "fwd+bwd CPU s", "fwd+bwd wall s", "predicted s"]
    header += ["MB sent (all ranks)", "split docs", "max relative load"]
    cal = data["calibration"]
    fit = (
        f"Cost model fitted on {len(cal['samples'])} timings (zigzag and hybrid) of other micro-batches, taken "
        f"first: median |error| "
        f"{cal['fit_median_abs_error']:.1%}, max {cal['fit_max_abs_error']:.1%} on its own samples."
    )
    return _measured_on(data) + " " + fit + "\n\n" + markdown(header, rows)


def _replay_table(run: dict, clock: str) -> str:
    rows = []
    for name, row in run["rows"].items():
        error = row.get("micro_batch_error") or {}
        rows.append(
            [
                name,
                row["layout"],
                str(row["num_steps"]),
                fmt(row["mean_tokens_per_step"], ",.0f"),
                fmt(row["epoch_seconds"], ".1f"),
                fmt(row["compute_seconds"], ".1f"),
                fmt(row["all_reduce_seconds"] + row["optimizer_seconds"], ".2f"),
                fmt(row["measured_speedup"], ".3f") + "x",
                fmt(row["predicted_speedup"], ".3f") + "x",
                fmt(error.get("median_abs_error"), ".1%"),
                fmt(row["wall_over_cpu"], ".2f"),
            ]
        )
    header = ["plan", "layout", "steps", "tokens/step", f"epoch s ({clock})", "compute s", "all-reduce + optimizer s"]
    header += [f"measured speedup vs {run['baseline']}", "predicted speedup", "median micro-batch error", "wall/CPU"]
    topo = run["topology"]
    ranking = (
        f"dp {topo['dp']} x cp {topo['cp']}, M = {topo['micro_batches']}, {run['processes']} processes at once on "
        f"{run.get('cores', '?')} cores; "
        f"load average {run['load_before'][0]} before, {run['load_after'][0]} after; {run['seconds']:.0f} s wall. "
        f"Measured ranking: {', '.join(run['ranking_measured'])}; predicted: {', '.join(run['ranking_predicted'])} "
        f"(ranking_correct: {str(run['ranking_correct']).lower()})."
    )
    return markdown(header, rows) + "\n\n" + ranking


def replay() -> str:
    data = load("replay")
    return _replay_table(data["runs"]["dp2"], data["clock_of_figures"])


def replay_layout() -> str:
    data = load("replay")
    return _replay_table(data["runs"]["layout"], data["clock_of_figures"])


def calibration() -> str:
    data = load("calibration")
    report = data["report"]
    rows = [
        [
            name.replace("_", " "),
            str(part["count"]),
            fmt(part["median_abs_error"], ".1%"),
            fmt(part["p90_abs_error"], ".1%"),
            fmt(part["max_abs_error"], ".1%"),
        ]
        for name, part in report.items()
        if isinstance(part, dict) and "p90_abs_error" in part and "max_abs_error" in part
    ]
    table = markdown(["micro-batches", "count", "median abs error", "p90 abs error", "max abs error"], rows)
    splits = report.get("splits")
    if not splits or "median_abs_error" not in splits:
        return table
    machine = report.get("machine", {})
    pct = {k: fmt(splits[k], ".1%") for k in splits if k.endswith("abs_error")}
    return (
        f"{table}\n\nHeld out over {splits['count']} splits by micro-batch: median |error| {pct['median_abs_error']} "
        f"(median over splits; worst split {pct['worst_median_abs_error']}), p90 {pct['median_p90_abs_error']} "
        f"(median; worst split {pct['worst_p90_abs_error']}). Targets (median <= 5%, p90 <= 10%) "
        f"{'met' if report.get('meets_targets') else 'missed'}. Clock: {report.get('clock')}, "
        f"{machine.get('cores')} cores, load average {fmt(machine['loadavg_before'][0], '.1f')} before and "
        f"{fmt(machine['loadavg_after'][0], '.1f')} after timing, {fmt(report.get('timing_seconds'), '.0f')} s of "
        f"timing, {fmt(report.get('runs_per_micro_batch'), '.1f')} runs per micro-batch on average."
    )


def open_checks() -> str:
    data = load("open_checks")
    rows = []
    for name, corpus in data["corpora"].items():
        for cache in ("cold", "warm"):
            result = corpus.get(cache)
            if not result:
                continue
            rows.append(
                [
                    f"{name} ({corpus['bytes'] / 1e9:.2f} GB, {corpus['rows']:,} rows, "
                    f"mean {corpus['mean_row_tokens']:.0f} tokens/row)",
                    cache,
                    fmt(result["wall"]["open_checks_share_of_full_read"], ".1%"),
                    fmt(result["cpu"]["open_checks_share_of_full_read"], ".1%"),
                    fmt(result["wall"]["checks_added_share_of_full_read"], ".1%"),
                    fmt(result["wall"].get("open_checks_share_of_verify"), ".2%"),
                ]
            )
    header = ["corpus", "page cache", "open / full read (wall)", "open / full read (CPU)"]
    header += ["checks alone / full read (wall)", "open / verify (wall)"]
    cold = f"\n\nCold runs: {data['cold_unavailable']}." if data.get("cold_unavailable") else ""
    return markdown(header, rows) + cold + _record_line(data)


def _machine(data: dict) -> str:
    m = data["machine"]
    load_start, load_end = m["load_average_start"][0], m["load_average_end"][0]
    return f"{data['clock']} clock, {m['cpus']} cores, 1-minute load {load_start} at start and {load_end} at end"


def _record_line(data: dict) -> str:
    """How a record was measured, from the record: date, clock, cores, load at start and end, command."""
    return f"\n\nMeasured {data['date']} UTC: {_machine(data)}; `{data['command']}`."


def window_first_batch() -> str:
    data = load("window_planning")
    first = data["first_micro_batch"]
    runs = [(f"{r['window_steps']} steps", r) for r in first["windows"]] + [("default", first["default"])]
    if "whole_epoch" in first:
        runs.append(("whole epoch (one window)", first["whole_epoch"]))
    rows = [
        [name, f"{r['window_docs']:,}", f"{r['windows']:,}", f"{r['cpu_seconds']:.2f} s",
         f"{r['peak_rss_above_lengths_mib']:,.0f} MiB"]
        for name, r in runs
    ]  # fmt: skip
    table = markdown(
        ["window", "documents per window", "windows", "CPU to first micro-batch", "peak RSS above lengths"], rows
    )
    scan = first["scan"]
    return (
        f"{table}\n\n{first['documents']:,} documents ({first['default']['lengths_mib']:,.0f} MiB of int64 "
        f"lengths, memory-mapped); the pass over the lengths every sampler makes took {scan['cpu_seconds']:.2f} s "
        f"({scan['ns_per_document']:.1f} ns per document). Measured in a fresh process per row: {_machine(data)}."
    )


def window_quality(key: str = "quality") -> str:
    data = load("window_planning")
    if key not in data:
        return "(not measured in the last run of benchmarks/window_planning.py)"
    steps = [r["window_steps"] for r in data["first_micro_batch"]["windows"]]
    rows = []
    for row in data[key]:
        d = row["default"]
        rows.append(
            [row["distribution"], row["topology"], f"{row['documents']:,}", fmt(row["whole_epoch"], ".4f")]
            + [fmt(row[f"steps_{s}"]["loss"], "+.4f") for s in steps]
            + [f"{d['windows']} x {d['window_docs']:,}", fmt(d["loss"], "+.4f")]
        )
    header = ["distribution", "topology", "documents", "whole-epoch efficiency"] + [f"loss, {s} steps" for s in steps]
    return markdown(header + ["default windows", "loss, default"], rows) + f"\n\nGoals: {goals_cell(data['goals'])}."


def window_billion() -> str:
    data = load("window_planning")
    first = data["first_micro_batch"]
    d, scan = first["default"], first["scan"]
    plan_cpu = max(0.0, d["cpu_seconds"] - scan["cpu_seconds"])
    n = 1_000_000_000
    mem = f"{d['peak_rss_above_lengths_mib']:,.0f} MiB peak"
    pages = f"{n * 8 / 2**30:.1f} / {n * 4 / 2**30:.1f} GiB file pages"
    rows = [
        ["pass over the lengths (check, sum, fingerprint)", f"{scan['ns_per_document']:.1f} s", "one 8 MiB chunk"],
        ["plan the first window (same window size as at 30M)", f"{plan_cpu:.1f} s", mem],
        ["lengths (int64 / int32 .npy, memory-mapped, shared page cache)", "-", pages],
        ["step count per window (for len and positions)", "-", f"{n // d['window_docs'] + 1:,} ints"],
    ]  # fmt: skip
    total = scan["ns_per_document"] * n / 1e9 + plan_cpu
    return markdown(["per rank, 1B documents", "CPU", "memory"], rows) + (
        f"\n\nAbout {total:.0f} s of CPU before the first micro-batch, scaled from the 30M measurement above "
        "(the pass over the lengths grows with the corpus, the window's plan does not)."
    )


def post_training() -> str:
    data = load("post_training")
    rows = [
        [
            row["case"],
            str(row["mini_batches"]),
            row["planner"],
            str(row["micro_batches"]),
            fmt(row["worst_ratio"], ".4f"),
            fmt(row["mean_ratio"], ".4f"),
            fmt(row.get("pipeline_order_saving"), ".1%"),
            fmt(row["plan_cpu_ms"], ".0f"),
        ]
        for row in sorted(data["rows"], key=lambda r: (r["case"], r["mini_batches"], r["planner"]))
    ]
    header = ["batch, topology", "mini-batches", "planner", "micro-batches (max)", "worst step / bound"]
    header += ["mean step / bound", "1F1B saving of the pipeline order", "plan CPU ms"]
    goal = data["goal"]
    return (
        f"{markdown(header, rows)}\n\nSeeds {', '.join(map(str, data['seeds']))} (one batch each); verl: "
        f"{data['verl']}. Goal (balancer's worst step within 3% of the bound on "
        f"{'; '.join(goal.get('cases', ['every case']))}): "
        f"{'met' if goal['met'] else 'missed'}. Plan times: {_machine(data)}."
    )


def balance_batch_speed() -> str:
    data = load("balance_batch_speed")
    rows = []
    for row in data["rows"]:
        after, before = row["after"] or {}, row["before"] or {}
        rows.append(
            [
                row["option"],
                f"{row['rollouts']:,}",
                fmt(after.get("cpu_seconds"), ".3f"),
                fmt(before.get("cpu_seconds"), ".3f") if before else "not run (quadratic)",
                fmt(after.get("imbalance") and after["imbalance"] - 1, ".1e"),
                fmt(before.get("imbalance") and before["imbalance"] - 1, ".1e") if before else "-",
                f"{after.get('micro_batches', '-')} / {before.get('micro_batches', '-')}",
            ]
        )
    header = ["option", "rollouts", "CPU s", "CPU s before", "imbalance - 1", "imbalance - 1 before"]
    header += ["micro-batches per rank (now / before)"]
    goals = "; ".join(f"{name}: {'met' if ok else 'missed'}" for name, ok in data["goals"].items())
    return (
        f"{markdown(header, rows)}\n\nAt commit {data.get('commit', '?')[:10]}; before: git revision {data['ref']}; "
        f"best of {data['repeat']} paired runs. "
        f"Goals: {goals}.{_record_line(data)}"
    )


def plan_validate() -> str:
    data = load("plan_validate")
    rows = [
        [
            f"{r['documents']:,} ({r['placements']:,} placements, {r['steps']:,} steps)",
            fmt(r["plan_s"], ".1f"),
            fmt(r["validate_s"], ".2f"),
            f"{fmt(r['load_npz_s'], '.2f')} ({fmt(r['load_npz_unvalidated_s'], '.2f')})",
            f"{fmt(r['load_json_s'], '.2f')} ({fmt(r['load_json_unvalidated_s'], '.2f')})",
        ]
        for r in data["rows"]
    ]
    load_avg = data["machine"]["load_average_start"][0]
    header = ["documents", "plan (s)", "validate (s)", "load .npz (unvalidated)", "load JSON (unvalidated)"]
    note = (
        f"\n\n{data['topology']}; process CPU seconds, best of the repeats, {data['machine']['cpus']} cores, load "
        f"average {load_avg} at start ({data['date']})."
    )
    return markdown(header, rows) + note


def import_time() -> str:
    data = load("import_time")
    machine = data["machine"]
    rows = [
        [f"`{name}`", fmt(r["cpu_median"], ".3f"), fmt(r["wall_median"], ".3f"), fmt(r["cpu_vs_import_torch"], ".2f")]
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
        f"{machine['load_average_end'][0]} at end; CPU = user + system time of the child process."
    )
    return markdown(header, rows) + note


def measured_balance(name: str = "measured_balance") -> str:
    """Static (shadow) against adapt on pinned CPU ranks (benchmarks/measured_balance.py), per configuration."""
    data = load(name)
    header = ["ranks", "pairs", "static s/step", "adapt s/step", "adapt speedup: median (min)",
              "attainable speedup: median (documents divisible)", "measured imbalance static / adapt",
              "prediction error before refit: median / p90",
              "after the first refit (fresh micro-batches): median / p90", "the same within steps",
              "fitted speeds (last adapt run)", "monitor CPU / step CPU", "refit CPU s",
              "1-min load during runs"]  # fmt: skip
    rows = []
    for c in data["configs"]:
        runs = {m: [r for r in c["runs"] if r["mode"] == m] for m in ("static", "adapt")}

        def med(mode, key, i=None):
            vals = [r[key] if i is None else r[key][i] for r in runs[mode]]
            vals = [v for v in vals if v is not None and v == v]
            return float(sorted(vals)[len(vals) // 2]) if vals else None

        def fresh(key, i):
            vals = sorted(r["after_first_refit"][key][i] for r in c["runs"] if key in r.get("after_first_refit", {}))
            return float(vals[len(vals) // 2]) if vals else None

        speeds = runs["adapt"][-1]["rank_speeds_fitted"]
        loads = [r["load_1min_at_start"] for r in c["runs"]]
        rows.append([
            f"{c['config']} (dp{c['dp']} x cp{c['cp']}{_cp_sizes(c)})", str(len(c["pairs"])),
            fmt(med("static", "mean_step_seconds")), fmt(med("adapt", "mean_step_seconds")),
            f"{c['speedup_median']:.3f}x ({c['speedup_min']:.3f}x)", _attainable(c["pairs"]),
            f"{fmt(med('static', 'measured_imbalance_after_second_window'))} / "
            f"{fmt(med('adapt', 'measured_imbalance_after_second_window'))}",
            f"{fmt(med('static', 'prediction_error_before', 0), '.1%')} / "
            f"{fmt(med('static', 'prediction_error_before', 1), '.1%')}",
            f"{fmt(fresh('median_p90', 0), '.1%')} / {fmt(fresh('median_p90', 1), '.1%')}",
            f"{fmt(fresh('within_step_median_p90', 0), '.1%')} / {fmt(fresh('within_step_median_p90', 1), '.1%')}",
            "-" if speeds is None else ", ".join(f"{x:.2f}" for x in speeds),
            fmt(max(r["monitor_cpu_fraction"] for r in c["runs"]), ".2%"),
            fmt(max(r["refit_cpu_seconds"] for r in c["runs"]), ".2f"),
            f"{min(loads):.1f}-{max(loads):.1f}",
        ])  # fmt: skip
    note = (
        f"\n\nMedians over the pairs (a run's figures: the steps after its second window; errors: median over the "
        f"runs of each run's median and p90; monitor CPU and refit CPU: the largest run). Planner takes rank speeds: "
        f"{fmt(data['planner_takes_rank_speeds'])}."
    )
    return markdown(header, rows) + note + _record_line(data)


def _attainable(pairs: list) -> str:
    """Median attainable speedup of the pairs (benchmarks/measured_balance.py ATTAINABLE_RULE) and the same with
    every document divisible; "-" where the run has none (CP > 1, or results from before it was measured)."""
    best = sorted(p["attainable_speedup"] for p in pairs if p.get("attainable_speedup"))
    divisible = sorted(p["divisible_speedup"] for p in pairs if p.get("divisible_speedup"))
    if not best:
        return "-"
    return f"{best[len(best) // 2]:.3f}x ({divisible[len(divisible) // 2]:.3f}x)"


def _cp_sizes(config: dict) -> str:
    sizes = config.get("cp_sizes")
    return "" if not sizes else ", cp_sizes " + "/".join(str(x) for x in sizes)


TABLES: dict[str, Callable[[], str]] = {
    "measured_balance": measured_balance,
    "measured_balance_dynamic": lambda: measured_balance("measured_balance_dynamic"),
    "measured_balance_uneven_w10": lambda: measured_balance("measured_balance_uneven_w10"),
    "measured_balance_interleaved": lambda: measured_balance("measured_balance_interleaved"),
    "measured_balance_interleaved_cp": lambda: measured_balance("measured_balance_interleaved_cp"),
    "measured_balance_interleaved_cp2": lambda: measured_balance("measured_balance_interleaved_cp2"),
    "measured_balance_interleaved_e524781": lambda: measured_balance("measured_balance_interleaved_e524781"),
    "measured_balance_interleaved_cp_e524781": lambda: measured_balance("measured_balance_interleaved_cp_e524781"),
    "measured_balance_interleaved_unpermuted": lambda: measured_balance("measured_balance_interleaved_unpermuted"),
    "measured_balance_interleaved_micro_batch_speeds": lambda: measured_balance(
        "measured_balance_interleaved_micro_batch_speeds"
    ),
    "import_time": import_time,
    "plan_validate": plan_validate,
    "post_training": post_training,
    "balance_batch_speed": balance_batch_speed,
    "window_first_batch": window_first_batch,
    "window_quality": window_quality,
    "window_quality_scaled": lambda: window_quality("quality_scaled"),
    "window_billion": window_billion,
    "dynamic_cp": dynamic_cp,
    "dynamic_cp_communication": dynamic_cp_communication,
    "hybrid_layout": hybrid_layout,
    "hybrid_layout_runs": hybrid_layout_runs,
    "hybrid_layout_mixed": lambda: hybrid_layout("hybrid_layout_mixed"),
    "replay": replay,
    "replay_layout": replay_layout,
    "calibration": calibration,
    "open_checks": open_checks,
    "pack_throughput": pack_throughput,
    "planner_quality": planner_quality,
    "planner_speed": planner_speed,
    "compare_speedup": compare_speedup,
    "compare_all": compare_all,
    "compare_peers": compare_peers,
    "trainer_compare": trainer_compare,
    "cp_attention_cpu": cp_attention_cpu,
    "pretokenize_throughput": pretokenize_throughput,
}
MARKER = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def stated_table(name: str) -> str | None:
    """The table `RESULT.KEY` a benchmark wrote into its own record, with the record's measuring line; None when
    the record states no such table."""
    result, _, key = name.partition(".")
    path = RESULTS / f"{result}.json"
    if not key or not path.exists():
        return None
    data = json.loads(path.read_text())
    spec = data.get("tables", {}).get(key)
    if spec is None:
        return None
    rows = [[fmt(cell) if not isinstance(cell, str) else cell for cell in row] for row in spec["rows"]]
    commit = (data.get("git") or {}).get("commit")
    line = _record_line(data)[:-1] + (f"; commit {commit[:10]}." if commit else ".")
    return markdown(spec["columns"], rows) + line


def render(page: str, path: Path) -> str:
    """The page with every marked table regenerated; unknown table names are an error."""

    def replace(match: re.Match) -> str:
        name = match.group("name")
        body = TABLES[name]() if name in TABLES else stated_table(name)
        if body is None:
            raise SystemExit(f"{path}: unknown table {name!r}; known: {', '.join(sorted(TABLES))} or RESULT.KEY")
        return match.group(1) + body + "\n" + match.group(4)

    return MARKER.sub(replace, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a page of docs/ is out of date")
    args = parser.parse_args(argv)
    placed, stale = set(), []
    for path in sorted(DOCS.glob("*.md")):
        page = path.read_text()
        placed |= {match.group("name") for match in MARKER.finditer(page)}
        fresh = render(page, path)
        if fresh == page:
            continue
        if args.check:
            stale.append(path)
        else:
            path.write_text(fresh)
            print(f"wrote {path}")
    missing = sorted(set(TABLES) - placed)
    if missing:
        raise SystemExit(f"no page of {DOCS} shows the tables {', '.join(missing)}")
    if stale:
        print(f"out of date: {', '.join(map(str, stale))}: run python benchmarks/tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
