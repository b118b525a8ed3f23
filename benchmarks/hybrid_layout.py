"""Hybrid vs zigzag CP layout on CPU: bytes sent and forward+backward time of cp_attention, 2 gloo ranks, 1 thread each.

Questions: (1) on an SFT-like micro-batch (200 documents of 16-4000 tokens) and on a mixed one (a few 6-12K documents
among short ones), how many bytes does each rank send, and how long does a forward+backward take, with the hybrid
layout (default options) against zigzag, for ring and all-gather attention? (2) does the hybrid layout given a cost
model calibrated here (`cost=`: per-piece and communication terms, fitted on other micro-batches timed first) pick
what is fastest, zigzag included? (3) which split_threshold is best, and is the default (automatic: split the fewest
longest documents that keep every rank within 2% of an even share of attention pairs and tokens) as good as the
best fixed one? The sweep adds a third micro-batch with a few 2-3K documents among short ones, where a fixed
threshold above them leaves the ranks unbalanced.

Time: per repetition, the slowest rank's wall time (the step waits for it) and process CPU time (gloo threads
included); every configuration runs once per repetition, in reverse order on odd repetitions, so zigzag and hybrid
alternate and load from other processes hits both alike. Speedups are ratios within one repetition (zigzag /
hybrid), reported as median, min and max over repetitions. Bytes: payload each rank hands to the other
(attention.bytes_sent), forward+backward. The results file records the load average at start, per repetition
and at the end, and the machine's cores.

Calibration (before the timed configurations): `CALIBRATION` micro-batches of other lengths than the timed ones, each
with zigzag and the default hybrid layout (ring), slowest rank's process CPU time (min of 2 after a warm-up), fitted
with `CostModel.fit(fit_pieces=True, fit_comm=True)`.

Layouts that happen to be identical (a threshold above every document and the default) are timed separately: their
spread is a direct estimate of the timing noise.

Run: python benchmarks/hybrid_layout.py [--reps 5] [--seed 0] [--no-sweep | --sweep-batches ...] [--batches ...]
[--methods ...]
Writes benchmarks/results/hybrid_layout.json (--name to change).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _render as tb

import attention  # noqa: E402
import balancer  # noqa: E402
import balancer.planning.cost.predict  # noqa: E402
from attention import bytes_sent, reset_bytes_sent  # noqa: E402
from balancer.planning.cost.hybrid import explicit_layout  # noqa: E402
from balancer.planning.cost.microbatch import assignment_terms, rank_times  # noqa: E402
from benchmarks._common import write_result  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 64
WORLD = 2
SWEEP = [256, 1024, 2048, 4096, 8192]  # fixed split thresholds against the automatic default
BATCHES = ("sft", "mixed", "few_long")
CALIBRATION = 8  # micro-batches timed for the cost fit


def _log_uniform(rng, n: int, lo: int, hi: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.int64)


def micro_batches(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sft = _log_uniform(rng, 200, 16, 4000)
    mixed = np.concatenate([rng.integers(6000, 12001, 4), _log_uniform(rng, 120, 16, 2000)])
    few_long = np.concatenate([rng.integers(2000, 3001, 3), _log_uniform(rng, 40, 16, 600)])
    return {name: rng.permutation(lens) for name, lens in (("sft", sft), ("mixed", mixed), ("few_long", few_long))}


def calibration_batches(seed: int) -> list[np.ndarray]:
    """Micro-batches for the cost fit, drawn apart from the timed ones (another seed, 8-24K tokens): short documents
    alone, and with one to three long ones."""
    rng = np.random.default_rng(seed + 1000)
    out = []
    for i in range(CALIBRATION):
        n_long = i % 4
        longs = rng.integers(2000, 9001, n_long)
        budget = int(rng.integers(8000, 24001)) - int(longs.sum())
        short = _log_uniform(rng, max(4, budget // 300), 16, int(rng.choice([600, 2000, 4000])))
        out.append(rng.permutation(np.concatenate([longs, short[np.cumsum(short) <= max(budget, 64)]])))
    return out


def _calibrate(rank: int, seed: int) -> dict:
    """Time the calibration micro-batches (zigzag and default hybrid, ring) and fit a cost model on rank 0;
    every rank returns it (as a dict) with the samples."""
    lengths, kinds, seconds = [], [], []
    for lens in calibration_batches(seed):
        full = _full_tensors(lens)
        for kind in ("zigzag", "hybrid"):
            case = _Case(rank, lens, full, "ring", {"kind": kind})
            times = [max(r[1] for r in _gather(list(case.run()))) for _ in range(3)]  # CPU time, slowest rank
            lengths.append(lens)
            kinds.append(kind)
            seconds.append(min(times[1:]))
    box = [None]
    if rank == 0:
        model = balancer.CostModel.fit(
            lengths, seconds, fit_fixed=True, cp=2, layout=kinds, method="ring", fit_pieces=True, fit_comm=True
        )
        errors = [
            abs(balancer.planning.cost.predict.micro_batch_time(model, lens, 2, kind) / t - 1)
            for lens, kind, t in zip(lengths, kinds, seconds)
        ]
        box[0] = {
            "cost": model.to_dict(),
            "samples": [
                {"docs": int(lens.size), "tokens": int(lens.sum()), "max_doc": int(lens.max()), "layout": k, "cpu_s": t}
                for lens, k, t in zip(lengths, kinds, seconds)
            ],
            "fit_median_abs_error": statistics.median(errors),
            "fit_max_abs_error": max(errors),
        }
    dist.broadcast_object_list(box, src=0)
    return box[0]


def configs(sweep=BATCHES, batches=BATCHES, methods=("ring", "allgather"), cost=None) -> list[tuple[str, str, dict]]:
    """(batch, method, layout spec) to time; the split_threshold sweep on the batches in `sweep`."""
    out = []
    for batch in batches:
        if batch == "few_long":
            continue
        for method in methods:
            out.append((batch, method, {"kind": "zigzag"}))
            out.append((batch, method, {"kind": "hybrid"}))
            if cost is not None:
                out.append((batch, method, {"kind": "hybrid", "cost": cost, "method": method}))
    if sweep and "ring" in methods:
        for batch in [b for b in batches if b in sweep]:
            if batch == "few_long":
                out.append((batch, "ring", {"kind": "zigzag"}))
            for thr in SWEEP:
                out.append((batch, "ring", {"kind": "hybrid", "split_threshold": thr}))
            if batch == "few_long":
                out.append((batch, "ring", {"kind": "hybrid"}))
                if cost is not None:
                    out.append((batch, "ring", {"kind": "hybrid", "cost": cost, "method": "ring"}))
    return out


def _same_placement(a: attention.CPLayout, b: attention.CPLayout) -> bool:
    return np.array_equal(a.split_docs, b.split_docs) and np.array_equal(a.doc_rank, b.doc_rank)


def _same_as(todo: list, cases: list) -> list:
    """For each configuration given a cost model, the index of an earlier one of the same batch and method with
    the same placement (it is not timed again: that one's timings are its own), else None."""
    same = []
    for i, ((batch, method, spec), case) in enumerate(zip(todo, cases)):
        earlier = [
            j for j in range(i) if todo[j][:2] == (batch, method) and _same_placement(cases[j].layout, case.layout)
        ]
        same.append(earlier[0] if earlier and "cost" in spec else None)
    return same


def _relative_load(layout: attention.CPLayout) -> float:
    lens = np.diff(layout.cu_seqlens)
    pairs, tokens = int((lens * (lens + 1) // 2).sum()), int(lens.sum())
    cp = layout.cp_size
    return float(np.maximum(layout.work() * cp / pairs, layout.local_counts * cp / tokens).max())


def _full_tensors(lens: np.ndarray) -> list[torch.Tensor]:
    """q, k, v, dout of a whole micro-batch (the same on every rank)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(int(lens.sum()), h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]


class _Case:
    """One (batch, method, layout) on this rank and a timed forward+backward (inputs sharded before the clock)."""

    def __init__(self, rank: int, lens: np.ndarray, full: list[torch.Tensor], method: str, spec: dict) -> None:
        explicit = explicit_layout(np.asarray(lens), WORLD, spec)  # a cost-driven spec: the planner's split
        self.layout = attention.CPLayout.from_spec(np.concatenate([[0], np.cumsum(lens)]), WORLD, explicit)
        self.rank, self.full, self.method = rank, full, method

    def run(self) -> tuple[float, float, int]:
        q, k, v, dout = (self.layout.shard(t, self.rank) for t in self.full)
        x = [t.requires_grad_() for t in (q, k, v)]
        dist.barrier()
        reset_bytes_sent()
        wall, cpu = time.perf_counter(), time.process_time()
        out = attention.cp_attention(*x, self.layout, causal=True, method=self.method, backend="torch")
        out.backward(dout)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall, cpu, bytes_sent()


def _gather(values: list[float]) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    parts = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )  # fmt: skip
    batches = micro_batches(args.seed)
    calibration = _calibrate(rank, args.seed)
    todo = configs(() if args.no_sweep else args.sweep_batches, args.batches, args.methods, calibration["cost"])
    full = {name: _full_tensors(lens) for name, lens in batches.items() if any(t[0] == name for t in todo)}
    cases = [_Case(rank, batches[b], full[b], m, spec) for b, m, spec in todo]
    runs: list[list] = [[] for _ in todo]
    same = _same_as(todo, cases)
    loads = []
    for rep in range(args.reps + 1):  # repetition 0 warms up
        # odd repetitions run the configurations in reverse, so zigzag and hybrid take turns going first
        order = range(len(cases)) if rep % 2 == 0 else reversed(range(len(cases)))
        for i in order:
            if same[i] is not None:
                continue
            res = _gather(list(cases[i].run()))
            if rep:
                runs[i].append(res)
        loads.append(os.getloadavg()[0])
        if rank == 0:
            print(f"repetition {rep}/{args.reps} done, load {loads[-1]:.1f}", flush=True)
    runs = [runs[j] if j is not None else rr for rr, j in zip(runs, same)]
    if rank == 0:
        rows = [
            _row(b, m, spec, case.layout, rr, calibration["cost"]) for (b, m, spec), case, rr in zip(todo, cases, runs)
        ]
        for row, j in zip(rows, same):
            if j is not None:
                row["timed_as"] = todo[j][2]  # same placement as this configuration: its timings
        queue.put((rows, loads, calibration))
    dist.barrier()
    dist.destroy_process_group()


def _row(batch: str, method: str, spec: dict, lay: attention.CPLayout, rr: list, cost: dict) -> dict:
    """One configuration's record: per repetition, every rank's (wall, CPU, bytes); the calibrated prediction."""
    walls = [max(r[0] for r in rep) for rep in rr]  # the step waits for the slowest rank
    cpus = [max(r[1] for r in rep) for rep in rr]
    return {
        "batch": batch,
        "method": method,
        "layout": spec,
        "fwd_bwd_s": statistics.median(walls),
        "fwd_bwd_cpu_s": statistics.median(cpus),
        "wall_s_all": walls,
        "cpu_s_all": cpus,
        "rank_wall_s": [[r[0] for r in rep] for rep in rr],
        "rank_cpu_s": [[r[1] for r in rep] for rep in rr],
        "bytes_per_rank": [int(r[2]) for r in rr[0]],
        "split_docs": int(lay.split_docs.sum()),
        "travelling_tokens": int(lay.kv_counts.sum()),
        "tokens_per_rank": lay.local_counts.tolist(),
        "pairs_per_rank": lay.work().tolist(),
        "relative_load": _relative_load(lay),
        "predicted_s": _predicted(lay, cost, method),
    }


def _predicted(lay: attention.CPLayout, cost: dict, method: str) -> float:
    """The slowest rank's predicted time of this layout's split set and placement under `cost`."""
    model = balancer.CostModel.from_dict(cost)
    lens = np.diff(lay.cu_seqlens)
    terms = assignment_terms(lens, lay.cp_size, lay.split_docs, np.maximum(lay.doc_rank, 0), model.causal, model.window)
    return float(rank_times(model, terms, method).max())


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def _ratios(rows: list[dict]) -> dict:
    """zigzag / hybrid (default options) per batch and method: bytes, and time ratios paired by repetition (both
    layouts timed in the same repetition, minutes apart at most), as median, min and max over repetitions."""
    out = {}
    for zig in rows:
        if zig["layout"] != {"kind": "zigzag"}:
            continue
        hyb = next(
            (r for r in rows if r["batch"] == zig["batch"] and r["method"] == zig["method"]
             and r["layout"] == {"kind": "hybrid"}),
            None,
        )  # fmt: skip
        if hyb is None:
            continue
        zb, hb = sum(zig["bytes_per_rank"]), sum(hyb["bytes_per_rank"])
        chosen = next(
            (r for r in rows if r["batch"] == zig["batch"] and r["method"] == zig["method"] and "cost" in r["layout"]),
            None,
        )
        out[f"{zig['batch']}/{zig['method']}"] = {
            "zigzag_bytes": zb,
            "hybrid_bytes": hb,
            "bytes_ratio": None if hb == 0 else zb / hb,  # None: hybrid sent nothing
            "hybrid_split_docs": hyb["split_docs"],
            "speedup_wall": _spread([z / h for z, h in zip(zig["wall_s_all"], hyb["wall_s_all"])]),
            "speedup_cpu": _spread([z / h for z, h in zip(zig["cpu_s_all"], hyb["cpu_s_all"])]),
            "predicted_speedup": zig["predicted_s"] / hyb["predicted_s"],
        }
        if chosen is not None:  # the hybrid layout given the calibrated cost model
            out[f"{zig['batch']}/{zig['method']}"]["with_cost"] = {
                "split_docs": chosen["split_docs"],
                "speedup_wall": _spread([z / h for z, h in zip(zig["wall_s_all"], chosen["wall_s_all"])]),
                "speedup_cpu": _spread([z / h for z, h in zip(zig["cpu_s_all"], chosen["cpu_s_all"])]),
                "predicted_speedup": zig["predicted_s"] / chosen["predicted_s"],
            }
    return out


def _label(key: str, value) -> str:
    return "cost=calibrated" if key == "cost" else f"{key}={value}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per configuration (after one warm-up)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the split_threshold sweep")
    ap.add_argument("--sweep-batches", nargs="+", choices=BATCHES, default=list(BATCHES), help="micro-batches to sweep")
    ap.add_argument("--batches", nargs="+", choices=BATCHES, default=list(BATCHES), help="micro-batches to time")
    ap.add_argument("--methods", nargs="+", choices=("ring", "allgather"), default=["ring", "allgather"])
    ap.add_argument("--name", default="hybrid_layout", help="result file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(r, WORLD, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows, loads, calibration = queue.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"worker failed with exit code {p.exitcode}")
    batches = micro_batches(args.seed)
    payload = {
        "config": {
            "world": WORLD,
            "threads_per_rank": 1,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": DIM,
            "dtype": "float32",
            "causal": True,
            "backend": "torch",
            "seed": args.seed,
            "reps": args.reps,
            "batches": {
                name: {"docs": int(lens.size), "tokens": int(lens.sum()), "max_doc": int(lens.max())}
                for name, lens in batches.items()
                if name in args.batches
            },
        },  # fmt: skip
        "load_average_1min_per_repetition": loads,
        "calibration": calibration,
        "wall_s": time.perf_counter() - t0,
        "ratios_zigzag_over_hybrid": _ratios(rows),
        "rows": rows,
    }
    path = write_result(args.name, payload, clock="wall+process_cpu")
    print("| batch | method | layout | fwd+bwd s | cpu s | MB sent (both ranks) | split docs | rel. load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        spec = ", ".join(_label(k, v) for k, v in r["layout"].items() if k != "kind" and v is not None)
        name = r["layout"]["kind"] + (f" ({spec})" if spec else "")
        print(
            f"| {r['batch']} | {r['method']} | {name} | {r['fwd_bwd_s']:.2f} | {r['fwd_bwd_cpu_s']:.2f} | "
            f"{sum(r['bytes_per_rank']) / 1e6:.1f} | {r['split_docs']} | {r['relative_load']:.3f} |"
        )
    for key, v in payload["ratios_zigzag_over_hybrid"].items():
        wall, cpu = v["speedup_wall"], v["speedup_cpu"]
        print(f"{key}: wall {wall['median']:.3f}x [{wall['min']:.3f}, {wall['max']:.3f}], "
              f"cpu {cpu['median']:.3f}x [{cpu['min']:.3f}, {cpu['max']:.3f}]")  # fmt: skip
    print(f"wrote {path}")


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_hybrid_layout(name: str = "hybrid_layout") -> str:
    data = tb.load(name)
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
                tb.ratio_spread(ratio["speedup_cpu"]),
                tb.ratio_spread(ratio["speedup_wall"]),
                tb.fmt(ratio["predicted_speedup"], ".2f") + "x",
                str(chosen["split_docs"]) if chosen else "-",
                tb.ratio_spread(chosen["speedup_cpu"]) if chosen else "-",
                tb.fmt(chosen.get("predicted_speedup"), ".2f") + ("x" if chosen else ""),
            ]
        )
    header = ["micro-batch", "method", "zigzag MiB sent", "hybrid MiB sent", "hybrid split docs"]
    header += ["speedup (CPU time)", "speedup (wall)", "predicted speedup", "with cost: split docs"]
    header += ["with cost: speedup (CPU time)", "with cost: predicted"]
    return tb.measured_on(data)[:-1] + f"; {tb.commit_note(data)}.\n\n" + tb.markdown(header, rows)


def table_hybrid_layout_runs() -> str:
    data = tb.load("hybrid_layout")
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
                tb.fmt(run["fwd_bwd_cpu_s"], ".2f"),
                tb.fmt(run["fwd_bwd_s"], ".2f"),
                tb.fmt(run["predicted_s"], ".2f"),
                tb.fmt(sum(run["bytes_per_rank"]) / 1e6, ".1f"),
                str(run["split_docs"]),
                tb.fmt(run["relative_load"]),
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
    return tb.measured_on(data)[:-1] + f"; {tb.commit_note(data)}. " + fit + "\n\n" + tb.markdown(header, rows)


TABLES = {  # docs/ marker name -> the table, from the record
    "hybrid_layout": table_hybrid_layout,
    "hybrid_layout_runs": table_hybrid_layout_runs,
    "hybrid_layout_mixed": lambda: table_hybrid_layout("hybrid_layout_mixed"),
}


if __name__ == "__main__":
    main()
