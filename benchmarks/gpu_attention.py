"""GPU check and kernel efficiency of every CP method's schedule, on one device (single-process simulation).

For each method (ring, allgather, ulysses) and CP size W, all W ranks' kernel calls run in this process
(:func:`attention.simulate.simulate`); no communication is timed.
  - correctness: the simulated output and gradients equal single-device ``varlen_attention`` (same backend, same
    dtype) within bf16 tolerances (1e-2 output, 2e-2 gradients, relative to the largest value);
  - kernel efficiency: ``t_single / sum(kernel times of the schedule's pieces)``, forward and backward, where
    ``t_single`` is one single-device call over the same tokens. 1.0 = splitting costs nothing; below 1: smaller
    kernel calls, merges and launches.
Defaults: bf16, torch backend, causal, zigzag, documents 256..64K tokens (131K tokens), 32 heads / 8 K/V heads, head
dim 128, unwindowed and with a 4,095-token sliding window (``--windows``: left window sizes, -1 = none; windowed
zigzag schedules hold the tall blocks the kernels' window mapping once misread). ``--device cpu --tiny`` runs the
same code on CPU in seconds (used by the tests). Writes benchmarks/results/gpu_attention.json (``--out`` to change)
with how it was measured (clock, machine and load, git commit, command).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attention  # noqa: E402
from attention.backends import get_backend  # noqa: E402
from attention.simulate import TimedBackend, simulate  # noqa: E402

LOAD_AT_START = os.getloadavg()

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_attention.json")
TOL_OUT, TOL_GRAD = 1e-2, 2e-2


def draw_lengths(seed: int, total: int, bands) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < total:
        a, b = bands[rng.choice(len(bands), p=[0.6, 0.3, 0.1][: len(bands)])]
        lens.append(int(np.exp(rng.uniform(np.log(a), np.log(b)))))
    return np.array(lens)


class Clock:
    """Kernel timer: CUDA events on a GPU (synchronised per call: kernel time only), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed(self, t0) -> float:
        if not self.cuda:
            return time.perf_counter() - t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return t0.elapsed_time(end) / 1e3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), 1e-30)


def single_device(q, k, v, cu, dout, be, clock: Clock, reps: int, window=(-1, -1)):
    """(out, grads, fwd seconds, bwd seconds) of one varlen call over all tokens, through the same timed backend."""
    times = {"fwd": [], "bwd": []}
    timed = TimedBackend(be, lambda kind, s, p: times[kind].append(s), clock.start, clock.elapsed)
    best = {"fwd": float("inf"), "bwd": float("inf")}
    for _ in range(reps + 1):  # the first run warms up
        times["fwd"].clear()
        times["bwd"].clear()
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attention.varlen_attention(*x, cu, causal=True, backend=timed, window_size=window)
        grads = torch.autograd.grad(out, x, dout)
        for kind in best:
            best[kind] = min(best[kind], sum(times[kind]))
    return out.detach(), grads, best["fwd"], best["bwd"]


def schedule(q, k, v, cu, dout, be, clock: Clock, method: str, world: int, reps: int, window=(-1, -1)):
    """(out, grads, summed fwd kernel seconds, summed bwd kernel seconds, kernel calls) of one method's schedule."""
    times = {"fwd": [], "bwd": []}
    timed = TimedBackend(be, lambda kind, s, p: times[kind].append(s), clock.start, clock.elapsed)
    best = {"fwd": float("inf"), "bwd": float("inf")}
    for _ in range(reps + 1):
        times["fwd"].clear()
        times["bwd"].clear()
        out, grads = simulate(q, k, v, cu, world, method, causal=True, backend=timed, dout=dout, window_size=window)
        for kind in best:
            best[kind] = min(best[kind], sum(times[kind]))
    return out, grads, best["fwd"], best["bwd"], len(times["fwd"])


def provenance(device: torch.device, argv) -> dict:
    """How this run was measured: clock, machine with load at start and end, commit, command."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return dict(
        clock="CUDA events around each kernel call (kernel time)" if device.type == "cuda" else "wall (perf_counter)",
        machine=dict(cpus=os.cpu_count(), load_average_start=[round(x, 2) for x in LOAD_AT_START],
                     load_average_end=[round(x, 2) for x in os.getloadavg()],
                     gpu=torch.cuda.get_device_name() if device.type == "cuda" else None),
        commit=commit or "unknown", command=shlex.join(["python", "benchmarks/gpu_attention.py", *argv]),
    )  # fmt: skip


def run_all(q, k, v, cu, dout, be, clock, args, heads: int, save=None):
    """Every (window, W, method) run: a dict per run and the list of failures; ``save(runs)`` after each run (a
    time limit that stops the script keeps what was measured)."""
    runs, failures = [], []
    for left in (int(w) for w in args.windows.split(",")):
        window = (left, -1)
        ref_out, ref_grads, t_fwd, t_bwd = single_device(q, k, v, cu, dout, be, clock, args.reps, window)
        for world in (int(w) for w in args.worlds.split(",")):
            for method in ("ring", "allgather", "ulysses"):
                if method == "ulysses" and heads % world:
                    continue
                out, grads, s_fwd, s_bwd, calls = schedule(q, k, v, cu, dout, be, clock, method, world, args.reps,
                                                           window)  # fmt: skip
                errs = [rel(out, ref_out)] + [rel(g, rg) for g, rg in zip(grads, ref_grads)]
                ok = errs[0] <= TOL_OUT and max(errs[1:]) <= TOL_GRAD
                runs.append(dict(method=method, world=world, window=list(window), kernel_calls_fwd=calls,
                                 single_s={"fwd": t_fwd, "bwd": t_bwd}, sum_kernel_s={"fwd": s_fwd, "bwd": s_bwd},
                                 efficiency={"fwd": t_fwd / s_fwd, "bwd": t_bwd / s_bwd}, rel_err=errs,
                                 exact=ok))  # fmt: skip
                failures += [] if ok else [f"{method} W={world} window={window}: errors {errs}"]
                if save is not None:
                    save(runs)
                print(f"| {method} | W={world} | window {left} | {be.name} | fwd eff {t_fwd / s_fwd:.3f} | bwd eff "
                      f"{t_bwd / s_bwd:.3f} | calls {calls} | max rel err {max(errs):.2e} | {'ok' if ok else 'FAIL'} |",
                      flush=True)  # fmt: skip
    return runs, failures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--backend", default="torch", help="attention backend (torch, flash_attn, flash_attn3, auto)")
    ap.add_argument("--tiny", action="store_true", help="small problem (seconds on CPU; for tests)")
    ap.add_argument("--worlds", default="2,4,8", help="CP sizes, comma separated")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (best is kept)")
    ap.add_argument("--windows", default="-1,4095", help="left sliding-window sizes, comma separated (-1 = none)")
    ap.add_argument("--out", default=OUT, help="result JSON path")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --device cpu)")
    if args.tiny:
        heads, kv_heads, dim, lens = 4, 2, 16, draw_lengths(0, 600, [(8, 64), (64, 200), (200, 300)])
    else:
        heads, kv_heads, dim, lens = 32, 8, 128, draw_lengths(0, 131072, [(256, 4096), (4096, 16384), (16384, 65536)])
    dtype = torch.bfloat16
    cu = np.concatenate([[0], np.cumsum(lens)])
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(int(cu[-1]), h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    windowed = any(int(w) >= 0 for w in args.windows.split(","))
    be = get_backend(args.backend, q, k, window=windowed, max_len=int(lens.max()))
    res = dict(backend=be.name, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               torch=torch.__version__, tokens=int(cu[-1]), num_docs=int(lens.size), longest=int(lens.max()),
               heads=heads, kv_heads=kv_heads, head_dim=dim, dtype="bfloat16", runs=[])  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save(runs):
        res.update(runs=runs, **provenance(device, sys.argv[1:] if argv is None else argv))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)

    runs, failures = run_all(q, k, v, cu, dout, be, Clock(device), args, heads, save)
    save(runs)
    if failures:
        raise SystemExit("not exact: " + "; ".join(failures))
    return res


if __name__ == "__main__":
    main()
