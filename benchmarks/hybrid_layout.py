"""Hybrid vs zigzag CP layout on CPU: bytes sent and forward+backward time of cp_attention, 2 gloo ranks, 1 thread each.

Questions: (1) on an SFT-like micro-batch (200 documents of 16-4000 tokens) and on a mixed one (a few 6-12K documents
among short ones), how many bytes does each rank send, and how long does a forward+backward take, with the hybrid
layout (default options) against zigzag, for ring and all-gather attention? (2) which split_threshold is best, and
is the default (automatic: split the fewest longest documents that keep every rank within 2% of an even share of
attention pairs and tokens) as good as the best fixed one? The sweep adds a third micro-batch with a few 2-3K
documents among short ones, where a fixed threshold above them leaves the ranks unbalanced.

Time: slowest rank's wall time per repetition (the step waits for it), median over repetitions; configurations are
interleaved repetition by repetition so that load from other processes hits them alike. CPU seconds (process time of
the slowest rank, gloo threads included) are recorded too. Bytes: payload each rank hands to the other
(attention._dist.bytes_sent), forward+backward.

Layouts that happen to be identical (a threshold above every document and the default) are timed separately: their
spread is a direct estimate of the timing noise.

Run: python benchmarks/hybrid_layout.py [--reps 3] [--seed 0] [--no-sweep] [--name hybrid_layout]
Writes benchmarks/results/hybrid_layout.json.
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
import attention  # noqa: E402
from attention import _dist  # noqa: E402
from benchmarks._common import write_result  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 64
WORLD = 2
SWEEP = [256, 1024, 2048, 4096, 8192]  # fixed split thresholds against the automatic default


def _log_uniform(rng, n: int, lo: int, hi: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.int64)


def micro_batches(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sft = _log_uniform(rng, 200, 16, 4000)
    mixed = np.concatenate([rng.integers(6000, 12001, 4), _log_uniform(rng, 120, 16, 2000)])
    few_long = np.concatenate([rng.integers(2000, 3001, 3), _log_uniform(rng, 40, 16, 600)])
    return {name: rng.permutation(lens) for name, lens in (("sft", sft), ("mixed", mixed), ("few_long", few_long))}


def configs(sweep: bool) -> list[tuple[str, str, dict]]:
    """(batch, method, layout spec) to time."""
    out = []
    for batch in ("sft", "mixed"):
        for method in ("ring", "allgather"):
            out.append((batch, method, {"kind": "zigzag"}))
            out.append((batch, method, {"kind": "hybrid"}))
    if sweep:
        for batch in ("sft", "mixed", "few_long"):
            if batch == "few_long":
                out.append((batch, "ring", {"kind": "zigzag"}))
            for thr in SWEEP:
                out.append((batch, "ring", {"kind": "hybrid", "split_threshold": thr}))
            if batch == "few_long":
                out.append((batch, "ring", {"kind": "hybrid"}))
    return out


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
        self.layout = attention.CPLayout.from_spec(np.concatenate([[0], np.cumsum(lens)]), WORLD, spec)
        self.rank, self.full, self.method = rank, full, method

    def run(self) -> tuple[float, float, int]:
        q, k, v, dout = (self.layout.shard(t, self.rank) for t in self.full)
        x = [t.requires_grad_() for t in (q, k, v)]
        dist.barrier()
        _dist.reset_bytes_sent()
        wall, cpu = time.perf_counter(), time.process_time()
        out = attention.cp_attention(*x, self.layout, causal=True, method=self.method, backend="torch")
        out.backward(dout)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall, cpu, _dist.bytes_sent()


def _gather(values: list[float]) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    parts = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def _worker(rank: int, world: int, port: int, seed: int, reps: int, sweep: bool, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )  # fmt: skip
    batches = micro_batches(seed)
    todo = configs(sweep)
    full = {name: _full_tensors(lens) for name, lens in batches.items()}
    cases = [_Case(rank, batches[b], full[b], m, spec) for b, m, spec in todo]
    runs: list[list] = [[] for _ in todo]
    for rep in range(reps + 1):  # repetition 0 warms up
        for i, case in enumerate(cases):
            res = _gather(list(case.run()))
            if rep:
                runs[i].append(res)
        if rank == 0:
            print(f"repetition {rep}/{reps} done, load {os.getloadavg()[0]:.1f}", flush=True)
    if rank == 0:
        rows = []
        for (batch, method, spec), case, rr in zip(todo, cases, runs):
            lay = case.layout
            rows.append(
                {
                    "batch": batch,
                    "method": method,
                    "layout": spec,
                    "fwd_bwd_s": statistics.median(max(r[0] for r in rep) for rep in rr),
                    "fwd_bwd_cpu_s": statistics.median(max(r[1] for r in rep) for rep in rr),
                    "fwd_bwd_best_s": min(max(r[0] for r in rep) for rep in rr),
                    "wall_s_all": [max(r[0] for r in rep) for rep in rr],
                    "bytes_per_rank": [int(r[2]) for r in rr[0]],
                    "split_docs": int(lay.split_docs.sum()),
                    "travelling_tokens": int(lay.kv_counts.sum()),
                    "tokens_per_rank": lay.local_counts.tolist(),
                    "pairs_per_rank": lay.work().tolist(),
                    "relative_load": _relative_load(lay),
                }
            )
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _ratios(rows: list[dict]) -> dict:
    """zigzag / hybrid (default options) for bytes and time, per batch and method."""
    out = {}
    for batch in ("sft", "mixed"):
        for method in ("ring", "allgather"):
            sel = [r for r in rows if r["batch"] == batch and r["method"] == method and len(r["layout"]) == 1]
            zig = next(r for r in sel if r["layout"]["kind"] == "zigzag")
            hyb = next(r for r in sel if r["layout"]["kind"] == "hybrid")
            zb, hb = sum(zig["bytes_per_rank"]), sum(hyb["bytes_per_rank"])
            out[f"{batch}/{method}"] = {
                "zigzag_bytes": zb,
                "hybrid_bytes": hb,
                "bytes_ratio": None if hb == 0 else zb / hb,  # None: hybrid sent nothing
                "speedup_wall": zig["fwd_bwd_s"] / hyb["fwd_bwd_s"],
                "speedup_cpu": zig["fwd_bwd_cpu_s"] / hyb["fwd_bwd_cpu_s"],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per configuration (after one warm-up)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the split_threshold sweep")
    ap.add_argument("--name", default="hybrid_layout", help="result file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    load = [os.getloadavg()]
    t0 = time.perf_counter()
    procs = [
        ctx.Process(target=_worker, args=(r, WORLD, port, args.seed, args.reps, not args.no_sweep, queue))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"worker failed with exit code {p.exitcode}")
    load.append(os.getloadavg())
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
            },
        },  # fmt: skip
        "load_average_before_after": load,
        "note": "other jobs shared the 2 cores during the run (see load averages); times are medians",
        "wall_s": time.perf_counter() - t0,
        "ratios_zigzag_over_hybrid": _ratios(rows),
        "rows": rows,
    }
    path = write_result(args.name, payload, clock="wall+process_cpu")
    print("| batch | method | layout | fwd+bwd s | cpu s | MB sent (both ranks) | split docs | rel. load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        spec = ", ".join(f"{k}={v}" for k, v in r["layout"].items() if k != "kind" and v is not None)
        name = r["layout"]["kind"] + (f" ({spec})" if spec else "")
        print(
            f"| {r['batch']} | {r['method']} | {name} | {r['fwd_bwd_s']:.2f} | {r['fwd_bwd_cpu_s']:.2f} | "
            f"{sum(r['bytes_per_rank']) / 1e6:.1f} | {r['split_docs']} | {r['relative_load']:.3f} |"
        )
    for key, v in payload["ratios_zigzag_over_hybrid"].items():
        print(key, {k: (round(x, 3) if isinstance(x, float) else x) for k, x in v.items()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
