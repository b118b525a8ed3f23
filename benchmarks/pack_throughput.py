"""Throughput and memory of `balancer pack` against `balancer pretokenize` on the same corpus.

Question: does writing balanced, pre-packed rows cost about what pretokenizing costs (pack should write bytes at
least 2/3 as fast as pretokenize), and does pack's memory stay flat as the token data grows?

Method (one run, one machine, both sides interleaved so a busy spell of a shared machine hits both alike): a
synthetic JSON-lines corpus whose documents have the lengths of a seeded random sample of the built-in WLB-LLM
trace (ASCII text, so the byte tokenizer gives exactly those token counts), at two sizes (the larger has twice the
documents). "pretokenize" = `balancer.data.pretokenize.pretokenize` (byte tokenizer, one process) of the corpus;
"pack" = `balancer.data.pack.pack` of that output for dp8 x cp2, 4 micro-batches, max_tokens 65536, 1 epoch
(planning included). Each runs in a fresh child process, timed around the call (interpreter start and imports
excluded); bytes = every file the call leaves in its output folder; peak RSS = the child's VmHWM (MiB), beside its
RSS after the imports (torch, datasets, transformers: the same floor for both sides). The planner
alone is timed in the pack child after the call, to split pack's time into planning and writing. Each figure is
the fastest of --repeat runs; every run's seconds are kept, with os.getloadavg() before and after.

Writes benchmarks/results/pack_throughput.json and prints markdown table rows.
Usage: python benchmarks/pack_throughput.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import _render as tb  # noqa: E402

TOPOLOGY = {"dp": 8, "cp": 2, "pp": 1, "micro_batches": 4, "max_tokens": 65536}
SHARD_TOKENS = 20_000_000


def make_corpus(path: Path, documents: int, seed: int = 0) -> dict:
    """JSON lines whose texts have the lengths (in bytes = byte-tokenizer tokens) of `documents` trace documents."""
    from balancer.data.traces import load_trace

    trace = load_trace("wlbllm")
    rng = np.random.default_rng(seed)
    lengths = trace[np.sort(rng.choice(len(trace), size=documents, replace=False))]
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    pool = alphabet[rng.integers(0, len(alphabet), size=int(lengths.max()) + 65536)].tobytes().decode()
    with open(path, "w", encoding="ascii") as f:
        for i, n in enumerate(lengths.tolist()):
            a = int(rng.integers(0, 65536))
            f.write(json.dumps({"text": pool[a : a + n], "id": i}) + "\n")
    return {"documents": documents, "tokens": int(lengths.sum()), "jsonl_bytes": path.stat().st_size}


CHILD = r"""
import json, os, sys, time
import datasets, transformers, balancer  # start-up cost, like the interpreter's: not timed
from balancer.data.pretokenize.options import PretokenizeOptions
from balancer.data.pretokenize.pipeline import pretokenize
from balancer.data.pack.build import pack
a = json.loads(sys.argv[1])
def status(key):  # KiB
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1])
rss_start = status("VmRSS:")
t0, c0 = time.perf_counter(), time.process_time()
if a["what"] == "pretokenize":
    m = pretokenize([a["input"]], a["output"], tokenizer="byte", progress=False,
                    options=PretokenizeOptions(shard_tokens=a["shard_tokens"]))
else:
    topo = balancer.Topology(**a["topology"])
    cost = balancer.CostModel(attn_coef=2 / 53000, linear_coef=1.0)
    m = pack(a["input"], a["output"], topo, cost, shard_tokens=a["shard_tokens"], progress=False)
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
res = {"seconds": seconds, "cpu_seconds": cpu, "tokens": m["counts"]["tokens"],
       "peak_rss_mib": status("VmHWM:") / 1024, "rss_after_imports_mib": rss_start / 1024}
if a["what"] == "pack":
    t1 = time.perf_counter()
    balancer.plan(balancer.read_lengths(a["input"]), topo, cost, seed=0)
    res["plan_seconds"] = time.perf_counter() - t1
print(json.dumps(res))
"""


def run_child(what: str, src: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    arg = {"what": what, "input": str(src), "output": str(out), "shard_tokens": SHARD_TOKENS, "topology": TOPOLOGY}
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(arg)], cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{what} child failed: {res.stderr[-2000:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    r["output_bytes"] = sum(p.stat().st_size for p in out.iterdir())
    r["mb_per_s"] = r["output_bytes"] / 2**20 / r["seconds"]
    r["cpu_mb_per_s"] = r["output_bytes"] / 2**20 / r["cpu_seconds"]  # less sensitive to other jobs than wall time
    if what == "pack":
        r["write_seconds"] = r["seconds"] - r["plan_seconds"]
        r["write_mb_per_s"] = r["output_bytes"] / 2**20 / r["write_seconds"]
    return r


def measure_size(work: Path, documents: int, repeat: int) -> dict:
    corpus = work / f"corpus_{documents}.jsonl"
    info = make_corpus(corpus, documents)
    tok, packed = work / f"tok_{documents}", work / f"packed_{documents}"
    runs: dict[str, list] = {"pretokenize": [], "pack": []}
    loads = [os.getloadavg()]
    for _ in range(repeat):
        runs["pretokenize"].append(run_child("pretokenize", corpus, tok))
        runs["pack"].append(run_child("pack", tok, packed))
        loads.append(os.getloadavg())
    entry = {**info, "loadavg": loads}
    for what, rs in runs.items():
        best = dict(min(rs, key=lambda r: r["seconds"]))
        best["all_seconds"] = [round(r["seconds"], 3) for r in rs]
        best["all_mb_per_s"] = [round(r["mb_per_s"], 1) for r in rs]
        entry[what] = best
    p, k = entry["pretokenize"], entry["pack"]
    entry["pack_vs_pretokenize_bytes_per_s"] = k["mb_per_s"] / p["mb_per_s"]
    entry["pack_writing_vs_pretokenize_bytes_per_s"] = k["write_mb_per_s"] / p["mb_per_s"]
    entry["pack_vs_pretokenize_bytes_per_cpu_s"] = max(r["cpu_mb_per_s"] for r in runs["pack"]) / max(
        r["cpu_mb_per_s"] for r in runs["pretokenize"]
    )
    # the same ratio for every repeat (pack run i against pretokenize run i, back to back)
    entry["ratio_per_repeat"] = [
        round(b["mb_per_s"] / a["mb_per_s"], 3) for a, b in zip(runs["pretokenize"], runs["pack"])
    ]
    for path in (corpus, tok, packed):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small corpora (a smoke run)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is reported")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    from _common import write_result

    base = 2000 if args.quick else 12_000
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pack_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = [measure_size(work, n, args.repeat) for n in (base, 2 * base)]
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    small, large = sizes
    payload = {
        "topology": TOPOLOGY,
        "shard_tokens": SHARD_TOKENS,
        "repeat": args.repeat,
        "sizes": sizes,
        "memory": {
            "tokens": [small["tokens"], large["tokens"]],
            "pack_peak_rss_mib": [small["pack"]["peak_rss_mib"], large["pack"]["peak_rss_mib"]],
            "pretokenize_peak_rss_mib": [small["pretokenize"]["peak_rss_mib"], large["pretokenize"]["peak_rss_mib"]],
            "pack_peak_above_imports_mib": [
                s["pack"]["peak_rss_mib"] - s["pack"]["rss_after_imports_mib"] for s in sizes
            ],
            "pack_output_mib": [small["pack"]["output_bytes"] / 2**20, large["pack"]["output_bytes"] / 2**20],
        },
    }
    path = write_result("pack_throughput" + ("_quick" if args.quick else ""), payload, clock="wall+process_cpu")
    print(f"wrote {path}")
    print(
        "| documents | tokens | pretokenize MB/s | pack MB/s (with planning) | pack writing MB/s | ratio | "
        "ratio per CPU second | pack peak RSS MiB (above imports) | pretokenize peak RSS MiB | loadavg (1 min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in sizes:
        p, k = s["pretokenize"], s["pack"]
        print(
            f"| {s['documents']:,} | {s['tokens'] / 1e6:.0f}M | {p['mb_per_s']:.0f} | {k['mb_per_s']:.0f} | "
            f"{k['write_mb_per_s']:.0f} | {s['pack_vs_pretokenize_bytes_per_s']:.2f} | "
            f"{s['pack_vs_pretokenize_bytes_per_cpu_s']:.2f} | {k['peak_rss_mib']:.0f} "
            f"({k['peak_rss_mib'] - k['rss_after_imports_mib']:.0f}) | {p['peak_rss_mib']:.0f} | "
            f"{min(x[0] for x in s['loadavg']):.1f}-{max(x[0] for x in s['loadavg']):.1f} |"
        )


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_pack_throughput() -> str:
    data = tb.load("pack_throughput")
    rows = []
    for size in data["sizes"]:
        pack, pretok = size["pack"], size["pretokenize"]
        rows.append(
            [
                f"{size['tokens']:,}",
                tb.fmt(pretok["mb_per_s"], ".1f"),
                tb.fmt(pack["mb_per_s"], ".1f"),
                ", ".join(tb.fmt(r, ".2f") for r in size["ratio_per_repeat"]),
                tb.fmt(size["pack_vs_pretokenize_bytes_per_cpu_s"], ".2f"),
                tb.fmt(pack["peak_rss_mib"] - pack["rss_after_imports_mib"], ".0f"),
                "-".join(tb.fmt(f(sample[0] for sample in size["loadavg"]), ".0f") for f in (min, max)),
            ]
        )
    header = ["tokens", "pretokenize MB/s", "pack MB/s", "pack/pretokenize per repeat", "per CPU s"]
    header += ["pack peak MiB above imports", "load avg (1 min)"]
    return tb.markdown(header, rows) + tb.record_line(data)[:-1] + f"; {tb.commit_note(data)}."


TABLES = {  # docs/ marker name -> the table, from the record
    "pack_throughput": table_pack_throughput,
}


if __name__ == "__main__":
    main()
