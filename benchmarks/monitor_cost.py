"""The BalanceMonitor's own CPU per step (`record` + `end_step`, the refits counted apart) in a real 4-rank gloo world
at `measured_balance.py`'s shapes, for this checkout against another one (`--against`, e.g. the main checkout).

Every rank builds the sampler and a monitor (shadow mode, `every=2`, as measured_balance.py) at that benchmark's
shapes (`cp1` = dp 4, `cp2` = dp 2 x cp 2, `dynamic` = dp 2 x cp 2 with cp_sizes 1/2/4; 8,192-token micro-batches, 2
per step, wlbllm lengths // 16), ranks pinned two per core, and walks `--windows` windows recording a synthetic time
per micro-batch (no model runs: only the monitor's work is on the clock, measured by the monitor itself as the
calling thread's CPU time). Worlds of the two checkouts alternate, `--pairs` times per configuration (which goes
first alternates too). The figure is the monitor's CPU per step (mean over ranks), and its share of the step's
process CPU that measured_balance.py recorded for the same configuration
(`benchmarks/results/measured_balance.json`; for `dynamic` `measured_balance_interleaved_cp.json`; the median over
its runs and ranks of the steps after the second window).

    python benchmarks/monitor_cost.py [--pairs 4] [--configs cp1,cp2,dynamic] [--against /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# name: (dp, cp, cp_sizes, measured_balance.py's record and configuration whose step CPU the share is of)
CONFIGS = {
    "cp1": (4, 1, None, "measured_balance", "equal"),
    "cp2": (2, 2, None, "measured_balance", "cp2"),
    "dynamic": (2, 2, (1, 2, 4), "measured_balance_interleaved_cp", "dynamic"),
}
CORES = [0, 0, 1, 1]


def _worker(rank, world, port, payload, out):
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {CORES[rank] % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))  # fmt: skip
    try:
        import measured_balance as mb

        import balancer
        from balancer.calibration import TINY_LLAMA
        from balancer.measured import BalanceMonitor

        dp, cp = payload["dp"], payload["cp"]
        lengths, window_docs, tps = mb._documents(payload["windows"], mb.STEPS_PER_WINDOW, dp, cp)
        cp_sizes = None if payload["cp_sizes"] is None else tuple(payload["cp_sizes"])
        topo = balancer.Topology(dp=dp, cp=cp, micro_batches=mb.MICRO_BATCHES, max_tokens=mb.MAX_TOKENS,
                                 tokens_per_step=tps, cp_sizes=cp_sizes)  # fmt: skip
        cost = balancer.CostModel.from_config(TINY_LLAMA)
        sampler = balancer.BalancedBatchSampler(lengths, topo, cost, rank=rank, seed=0, window_docs=window_docs)
        monitor = BalanceMonitor(sampler, mode="shadow", warmup_steps=1, min_samples=16, every=mb.GATHER_EVERY)
        rng = np.random.default_rng(rank)
        steps = 0
        for i, _ in enumerate(sampler):
            monitor.record(0.05 * (1 + 0.1 * rng.random()))
            if i % topo.micro_batches == topo.micro_batches - 1:
                monitor.end_step()
                steps += 1
        monitor.flush()
        Path(f"{out}.{rank}").write_text(json.dumps({"steps": steps, "cpu": monitor.cpu_seconds,
                                                     "refit": monitor.refit_seconds}))  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _world(code: str, config: str, windows: int) -> dict:
    """One world on checkout `code` (a subprocess importing that checkout's packages)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        env = {**os.environ, "PYTHONPATH": code, "GLOO_SOCKET_IFNAME": "lo"}
        cmd = [sys.executable, __file__, "--world", code, config, str(windows), out]
        subprocess.run(cmd, env=env, check=True)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    per_step = [r["cpu"] / r["steps"] for r in ranks]
    return {"steps": ranks[0]["steps"], "monitor_cpu_ms_per_step": 1e3 * float(np.mean(per_step)),
            "per_rank_ms": [1e3 * x for x in per_step], "refit_cpu_seconds": ranks[0]["refit"]}  # fmt: skip


def _spawn_world(code: str, config: str, windows: int, out: str) -> None:
    sys.path[:0] = [code, str(Path(code) / "benchmarks")]
    import torch.multiprocessing as mp

    dp, cp, cp_sizes = CONFIGS[config][:3]
    payload = {"dp": dp, "cp": cp, "cp_sizes": cp_sizes, "windows": windows}
    mp.spawn(_worker, args=(4, _port(), payload, out), nprocs=4, join=True)


def _port() -> int:
    """A free TCP port on 127.0.0.1 (here, not from _common: the world may run another checkout's benchmarks)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_cpu(config: str) -> float | None:
    """measured_balance.py's recorded step process CPU per rank (median over runs and ranks), or None."""
    record, name = CONFIGS[config][3:]
    path = ROOT / "benchmarks" / "results" / f"{record}.json"
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    runs = [r for c in rec["configs"] if c["config"] == name for r in c["runs"]]
    cpu = [x for r in runs for x in r["mean_step_process_cpu_per_rank"]]
    return float(np.median(cpu)) if cpu else None


def _table(results: list, codes: list) -> dict:
    from _common import table

    rows = []
    for c in results:
        for which in codes:
            m = c["summary"][which]
            share = m.get("share_of_step_cpu")
            rows.append([c["config"], which, str(sum(r["code"] == which for r in c["runs"])),
                         f"{m['median_ms']:.2f} ({m['min_ms']:.2f}-{m['max_ms']:.2f})",
                         "-" if not share else f"{share[0]:.2%} ({share[1]:.2%}-{share[2]:.2%})"])  # fmt: skip
    columns = ["ranks", "checkout", "worlds", "monitor CPU ms/step: median (min-max)", "share of the step's CPU"]
    return table(columns, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4, help="alternating pairs of worlds per configuration")
    ap.add_argument("--configs", default="cp1,cp2", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--windows", type=int, default=12, help="windows of 4-5 steps per world")
    ap.add_argument("--against", help="another checkout of the project to compare with (e.g. the previous commit)")
    ap.add_argument("--output", default="monitor_cost", help="results name (benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import write_result

    codes = {"this": str(ROOT)}
    if args.against:
        if not (Path(args.against) / "balancer" / "measured").is_dir():
            print(f"error: --against {args.against}: not a checkout of this project", file=sys.stderr)
            return 2
        codes["against"] = str(Path(args.against).resolve())
    results = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            print(f"error: --configs: unknown configuration {config!r} (one of {', '.join(CONFIGS)})", file=sys.stderr)
            return 2
        runs = []
        for pair in range(args.pairs):
            order = list(codes) if pair % 2 == 0 else list(codes)[::-1]
            for which in order:
                load = os.getloadavg()[0]
                r = _world(codes[which], config, args.windows)
                runs.append({"pair": pair, "code": which, "load_1min_at_start": load, **r})
                print(f"  {config} pair {pair} {which}: {r['monitor_cpu_ms_per_step']:.3f} ms/step, load {load:.1f}")
        step_cpu = _step_cpu(config)
        summary = {}
        for which in codes:
            ms = [r["monitor_cpu_ms_per_step"] for r in runs if r["code"] == which]
            summary[which] = {"median_ms": float(np.median(ms)), "min_ms": float(np.min(ms)),
                              "max_ms": float(np.max(ms))}  # fmt: skip
            if step_cpu:
                summary[which]["share_of_step_cpu"] = [summary[which][k] / 1e3 / step_cpu for k in
                                                       ("median_ms", "min_ms", "max_ms")]  # fmt: skip
        results.append({"config": config, "runs": runs, "summary": summary, "step_process_cpu_seconds": step_cpu})
        print(f"{config}: {json.dumps(summary)}")
    payload = {"configs": results, "codes": codes, "windows": args.windows, "shapes": "measured_balance.py's",
               "tables": {"cost": _table(results, list(codes))}}  # fmt: skip
    path = write_result(args.output, payload, clock="process_cpu")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--world":
        _spawn_world(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        sys.exit(0)
    sys.exit(main())
