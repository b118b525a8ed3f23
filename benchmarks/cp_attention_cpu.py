"""CPU parallel efficiency of cp_attention: 2 gloo ranks with one thread each vs one process with one thread.

Question: on packed documents of mixed lengths (16K-32K tokens, causal, zigzag layout), how close does the per-rank
time of cp_attention (ring, allgather, ulysses) come to half the single-process varlen_attention time, forward and
forward+backward? efficiency = t_single / (2 * t_rank), t_rank = slowest rank. Also: the CPU torch backend's
achieved GFLOP/s (causal forward, 4*pairs*H*D FLOPs) vs a plain fp32 matmul's, one thread.

Run: python benchmarks/cp_attention_cpu.py [--seed 0] [--reps 2]. Writes benchmarks/results/cp_attention_cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _render as tb

import attention  # noqa: E402
from benchmarks._common import write_result  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 64
METHODS = ("ring", "allgather", "ulysses")


def draw_lengths(seed: int, lo: int = 16_384, hi: int = 32_768) -> np.ndarray:
    """A mix: 60% short (64..1K), 30% medium (1K..4K), 10% long (4K..12K), log-uniform inside each band, drawn
    until the total is in [lo, hi]."""
    rng = np.random.default_rng(seed)
    bands = [(64, 1024), (1024, 4096), (4096, 12288)]
    lens: list[int] = []
    while sum(lens) < lo:
        a, b = bands[rng.choice(3, p=[0.6, 0.3, 0.1])]
        d = int(np.exp(rng.uniform(np.log(a), np.log(b))))
        if sum(lens) + d <= hi:
            lens.append(d)
    return np.array(lens)


def _timed(fn, reps: int, barrier: bool = True) -> tuple[float, float]:
    """Best (wall seconds, process CPU seconds) over ``reps`` runs. CPU time includes gloo's threads; it is
    what the run costs when other processes share the cores (wall time then also counts waiting for a core)."""
    best_w = best_c = float("inf")
    for _ in range(reps):
        if barrier:
            dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        fn()
        best_w, best_c = min(best_w, time.perf_counter() - t), min(best_c, time.process_time() - c)
    return best_w, best_c


def _matmul_gflops() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    return 2 * 1024**3 * 10 / (time.perf_counter() - t) / 1e9


def _worker(rank: int, world: int, port: int, lens: np.ndarray, reps: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(0)
    qf = torch.randn(T, HEADS, DIM, generator=gen)
    kf = torch.randn(T, KV_HEADS, DIM, generator=gen)
    vf = torch.randn(T, KV_HEADS, DIM, generator=gen)
    dof = torch.randn(T, HEADS, DIM, generator=gen)
    res = {}

    # single process (rank 0 alone; rank 1 waits, so the core is not shared)
    if rank == 0:

        def single(bwd):
            def run():
                x = [t.clone().requires_grad_(bwd) for t in (qf, kf, vf)]
                o = attention.varlen_attention(*x, cu, causal=True, backend="torch")
                if bwd:
                    o.backward(dof)

            return run

        for name, bwd in (("fwd", False), ("fwd_bwd", True)):
            single(bwd)()
            res[f"single_{name}_s"], res[f"single_{name}_cpu_s"] = _timed(single(bwd), reps, barrier=False)
        res["matmul_gflops"] = _matmul_gflops()
    dist.barrier()

    layout = attention.CPLayout.build(cu, world)
    ql, kl, vl, dol = (layout.shard(t, rank) for t in (qf, kf, vf, dof))
    for method in METHODS:
        for name, bwd in (("fwd", False), ("fwd_bwd", True)):

            def run():
                x = [t.clone().requires_grad_(bwd) for t in (ql, kl, vl)]
                o = attention.cp_attention(*x, layout, causal=True, method=method, backend="torch")
                if bwd:
                    o.backward(dol)

            run()
            t_mine = torch.tensor(_timed(run, reps), dtype=torch.float64)
            parts = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(parts, t_mine)
            res[f"{method}_{name}_rank_s"] = [float(p[0]) for p in parts]
            res[f"{method}_{name}_rank_cpu_s"] = [float(p[1]) for p in parts]
    if rank == 0:
        res["work_pairs_per_rank"] = layout.work(causal=True).tolist()
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    lens = draw_lengths(args.seed)
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    procs = [ctx.Process(target=_worker, args=(r, world, port, lens, args.reps, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"worker failed with exit code {p.exitcode}")
    pairs = int((lens * (lens + 1) // 2).sum())
    fwd_flops = 4.0 * pairs * HEADS * DIM
    summary = {
        "config": {
            "world": world,
            "threads_per_rank": 1,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": DIM,
            "dtype": "float32",
            "causal": True,
            "layout": "zigzag",
            "backend": "torch",
            "seed": args.seed,
            "reps": args.reps,
            "num_docs": int(lens.size),
            "tokens": int(lens.sum()),
            "max_doc": int(lens.max()),
            "lengths": lens.tolist(),
        },
        "torch": torch.__version__,
        "raw": res,
        "attention_fwd_gflops": fwd_flops / res["single_fwd_s"] / 1e9,
        "matmul_gflops": res["matmul_gflops"],
        "wall_s": time.perf_counter() - t0,
        "load_average_1min": [load_before, os.getloadavg()[0]],
    }
    summary["attention_vs_matmul"] = summary["attention_fwd_gflops"] / summary["matmul_gflops"]
    for method in METHODS:
        for name in ("fwd", "fwd_bwd"):
            t_rank = max(res[f"{method}_{name}_rank_s"])
            summary[f"{method}_{name}_efficiency"] = res[f"single_{name}_s"] / (2 * t_rank)
            t_cpu = max(res[f"{method}_{name}_rank_cpu_s"])
            summary[f"{method}_{name}_cpu_efficiency"] = res[f"single_{name}_cpu_s"] / (2 * t_cpu)
    write_result("cp_attention_cpu", summary, clock="wall+process_cpu")
    cols = [f"{m}_{n}" for m in METHODS for n in ("fwd", "fwd_bwd")]
    print(
        "| tokens | docs | load | "
        + " | ".join(c.replace("_bwd", "+bwd") + " wall (cpu)" for c in cols)
        + " | attn fwd GFLOP/s | matmul GFLOP/s |"
    )
    print("|" + "---|" * (len(cols) + 5))
    print(
        f"| {lens.sum()} | {lens.size} | {max(summary['load_average_1min']):.1f} | "
        + " | ".join(f"{summary[c + '_efficiency']:.2f} ({summary[c + '_cpu_efficiency']:.2f})" for c in cols)
        + f" | {summary['attention_fwd_gflops']:.1f} | {summary['matmul_gflops']:.1f} |"
    )


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_cp_attention_cpu() -> str:
    data = tb.load("cp_attention_cpu")
    cfg = data["config"]
    keys = [k for k in data if k.endswith("_efficiency")]
    rows = [[k.removesuffix("_efficiency").replace("_", " "), tb.fmt(data[k])] for k in keys]
    rows.append(["attention kernel vs matmul (GFLOP/s ratio)", tb.fmt(data.get("attention_vs_matmul"))])
    note = (
        f"{cfg['world']} gloo ranks x {cfg['threads_per_rank']} thread, {cfg['num_docs']} documents / "
        f"{cfg['tokens']:,} tokens (longest {cfg['max_doc']:,}), {cfg['heads']} heads ({cfg['kv_heads']} KV) x "
        f"{cfg['head_dim']}, {cfg['dtype']}, {cfg['layout']} layout. "
        + tb.measured_on(data)[:-1]
        + f"; {tb.commit_note(data)}."
    )
    return note + "\n\n" + tb.markdown(["schedule", "parallel efficiency"], rows)


TABLES = {  # docs/ marker name -> the table, from the record
    "cp_attention_cpu": table_cp_attention_cpu,
}


if __name__ == "__main__":
    main()
