"""GPU: per-GPU throughput of cp_attention as a fraction of single-GPU flash attention on 1/W of the work.

On one GPU the W ranks are emulated: for every rank r, the kernels cp_attention runs on rank r (all ring steps'
blocks, merges included, no communication) are timed on the GPU; the fraction is
``(t_single / W) / max_r t_rank`` where t_single is varlen_attention over the whole packed batch. It measures the
compute efficiency of splitting (smaller kernel calls, merges, balance), not the interconnect. Causal, zigzag,
bf16, documents drawn from the same mix as the CPU benchmark, scaled up. Writes benchmarks/results/gpu_attention.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attention  # noqa: E402
from attention.backends import get_backend  # noqa: E402
from attention.merge import Accumulator  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_attention.json")


def draw_lengths(seed: int, total: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bands = [(256, 4096), (4096, 16384), (16384, 65536)]
    lens: list[int] = []
    while sum(lens) < total:
        a, b = bands[rng.choice(3, p=[0.6, 0.3, 0.1])]
        lens.append(int(np.exp(rng.uniform(np.log(a), np.log(b)))))
    return np.array(lens)


def cuda_time(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    heads, kv_heads, dim, dtype = 32, 8, 128, torch.bfloat16
    lens = draw_lengths(0, 131072)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q = torch.randn(T, heads, dim, device="cuda", dtype=dtype)
    k = torch.randn(T, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn(T, kv_heads, dim, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    be = get_backend("auto", q, k)
    scale = dim**-0.5
    res = {
        "backend": be.name,
        "tokens": T,
        "num_docs": int(lens.size),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "dtype": "bfloat16",
        "device": torch.cuda.get_device_name(),
        "worlds": {},
    }

    def single(bwd):
        def run():
            x = [t.detach().requires_grad_(bwd) for t in (q, k, v)]
            o = attention.varlen_attention(*x, cu, causal=True, backend=be.name)
            if bwd:
                o.backward(dout)

        return run

    t_single = {n: cuda_time(single(b)) for n, b in (("fwd", False), ("fwd_bwd", True))}
    pairs = int((lens * (lens + 1) // 2).sum())
    res["single_s"] = t_single
    res["single_fwd_tflops"] = 4.0 * pairs * heads * dim / t_single["fwd"] / 1e12
    for world in (2, 4, 8):
        lay = attention.CPLayout.build(cu, world)
        shards = [[lay.shard(t, r) for t in (q, k, v, dout)] for r in range(world)]
        per_rank = {"fwd": [], "fwd_bwd": []}
        for r in range(world):
            ql, kl, vl, dl = shards[r]

            def fwd(r=r, ql=ql):
                acc = Accumulator()
                for s in range(world):
                    p = lay.pieces(r, s, True)
                    if len(p):
                        acc.add(*be.forward(ql, shards[s][1], shards[s][2], p, scale))
                return acc

            def fwd_bwd(r=r, ql=ql, dl=dl):
                acc = fwd()
                o = acc.out.to(dtype)
                for s in range(world):
                    p = lay.pieces(r, s, True)
                    if len(p):
                        be.backward(dl, ql, shards[s][1], shards[s][2], o, acc.lse, p, scale)

            per_rank["fwd"].append(cuda_time(fwd))
            per_rank["fwd_bwd"].append(cuda_time(fwd_bwd))
        res["worlds"][world] = {
            n: {"rank_s": per_rank[n], "fraction": t_single[n] / world / max(per_rank[n])} for n in per_rank
        }
        print(
            f"| W={world} | {be.name} | {T} | {res['worlds'][world]['fwd']['fraction']:.3f} | "
            f"{res['worlds'][world]['fwd_bwd']['fraction']:.3f} |",
            flush=True,
        )
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k != "worlds"}))


if __name__ == "__main__":
    main()
