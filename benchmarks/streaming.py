"""BalancedStream: balance against the map-style sampler, throughput against the plain streaming loop, memory.

1. Balance (`--part balance`, no processes, no timing): the same documents in the same order with the same window
   size (WINDOW_STEPS steps' documents, at most a quarter of the documents), planned by the map-style sampler's
   windows (`plan_window`, contiguous blocks of the epoch's shuffle) and by a stream's windows. The stream's
   source holds the documents in that same shuffled order, cut into SOURCE_SHARDS contiguous files; its windows
   are composed by the stream's own rules (sources.initial_streams, windows.quotas, the reserve of
   dp*micro_batches documents: `stream_windows` below replays them without processes) and planned by the
   stream's planning call (windows.replan_units). Epoch efficiency of both (the window plans concatenated into one
   plan, `Plan.metrics()`), for the wlbllm and prolong traces and an SFT mix (resampled to DOCS documents), dp4
   and dp8, without and with CP 2, seeds 0-2; target: within 0.02.
2. Throughput (`--part throughput`, 4 gloo ranks, one thread each, CPU): the same Parquet files (SFT-mix lengths)
   read through `datasets` streaming by (a) BalancedStream -> PackedCollator and (b) the plain loop it replaces:
   `split_dataset_by_node` + per-rank greedy packing (next-fit up to max_tokens * cp) -> PackedCollator.
   Paired alternating repetitions inside one world (a, b, a, b, ...); tokens/s = all ranks' tokens / the slowest
   rank's wall seconds (wall clock: speed is the point), process CPU seconds recorded beside. Also: the tokens/s
   one rank's tiny Llama (TINY_LLAMA, forward + backward, 1 thread) consumes on micro-batches of the same size,
   each rank's peak buffered tokens (`stream.stats()`) against 2 x window tokens / dp, and the bytes exchanged.
Writes benchmarks/results/streaming_balance.json and streaming_throughput.json.
Usage: python benchmarks/streaming.py [--part all|balance|throughput] [--quick]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import DEFAULT_COST, standard_topology, table, write_result

import balancer
from balancer.data.traces import load_trace
from balancer.planning.shuffle import EpochShuffle, num_windows
from balancer.planning.window import plan_window, window_seed
from balancer.streaming.reading import quotas
from balancer.streaming.sources import assign, initial_streams
from balancer.streaming.windows import replan_units

SOURCE_SHARDS = 16
DOCS = 40_000
WINDOW_STEPS = 16
MIN_WINDOWS = 4  # long-document traces hold few steps: their windows are cut smaller so that every row has >= 4
TOPOLOGIES = {"dp4": (4, 1), "dp8": (8, 1), "dp4xcp2": (4, 2), "dp8xcp2": (8, 2)}
M = 4


def stream_windows(order: np.ndarray, world: int, window_docs: int, reserve: int) -> list[np.ndarray]:
    """The stream's windows (global ids, window order) for a source holding `order` in SOURCE_SHARDS contiguous
    files read by `world` ranks: the rule of balancer.streaming.reading (quotas, the reserve, the extra rounds
    near the end; window order by (stream, item)). A stream "ends" when asked for more items than it has left."""
    files = np.array_split(order, SOURCE_SHARDS)
    specs = initial_streams(len(files), world)
    assert sum(len(a) for a in assign(len(specs), world)) == len(specs)
    items = [files[s.part][s.offset :: s.stride] for s in specs]
    n = len(specs)
    pos, ended = [0] * n, [False] * n
    out = []
    while not all(ended):
        q = quotas(ended, window_docs)
        live = [v for v in range(n) if not ended[v]]
        share = -(-reserve // len(live))
        given, held = [[] for _ in range(n)], [0] * n
        asks = {v: (int(q[v]) + share, int(q[v])) for v in live}  # v: (items wanted buffered, items given)
        while asks:
            for v, (upto, give) in asks.items():
                left = len(items[v]) - pos[v]
                if left < upto:
                    ended[v], give = True, left
                given[v].append(items[v][pos[v] : pos[v] + give])
                pos[v] += give
                held[v] = 0 if ended[v] else upto - give
            alive = [v for v in range(n) if not ended[v]]
            missing = reserve - sum(held[v] for v in alive)
            if not alive or missing <= 0:
                break
            asks = {v: (held[v] + -(-missing // len(alive)), 0) for v in alive}
        ids = np.concatenate([c for v in range(n) for c in given[v]])
        if len(ids):
            out.append(ids)
    return out


def _concat(lengths, topo, plans_ids) -> float:
    """Epoch efficiency of window plans (plan, global ids of its local documents) concatenated into one plan."""
    ptr, doc, start, end = [np.zeros(1, dtype=np.int64)], [], [], []
    for p, ids in plans_ids:
        ptr.append(p.mb_ptr[1:] + ptr[-1][-1])
        doc.append(p.doc if ids is None else ids[p.doc])
        start.append(p.start)
        end.append(p.end)
    whole = balancer.Plan(lengths, topo, DEFAULT_COST, np.concatenate(doc), np.concatenate(start),
                          np.concatenate(end), np.concatenate(ptr))  # fmt: skip
    return float(whole.metrics()["epoch_efficiency"])


def balance_row(trace: str, topo_name: str, seed: int) -> dict:
    lengths = load_trace(trace, n=DOCS, seed=seed)
    dp, cp = TOPOLOGIES[topo_name]
    topo = standard_topology(lengths, dp, cp, 1, M)
    per_step = topo.tokens_per_step * len(lengths) / float(lengths.sum())
    window_docs = max(topo.bins_per_step, min(int(np.ceil(WINDOW_STEPS * per_step)), len(lengths) // MIN_WINDOWS))
    k = num_windows(len(lengths), window_docs)
    sampler = [
        (plan_window(lengths, topo, DEFAULT_COST, seed=seed, epoch=0, index=i, window_docs=window_docs), None)
        for i in range(k)
    ]
    order = EpochShuffle(len(lengths), seed, 0)(np.arange(len(lengths)))
    windows = stream_windows(order, dp * cp, window_docs, topo.bins_per_step)
    stream = []
    for i, ids in enumerate(windows):
        seg = replan_units(lengths[ids], topo, DEFAULT_COST, window_seed(seed, 0, i, 0), "error", [])
        stream.append((seg.plan, ids))
    assert sorted(np.concatenate(windows).tolist()) == list(range(len(lengths)))
    e_sampler, e_stream = _concat(lengths, topo, sampler), _concat(lengths, topo, stream)
    return {
        "trace": trace, "topology": topo_name, "seed": seed, "docs": len(lengths), "window_docs": window_docs,
        "sampler_windows": k, "stream_windows": len(windows), "sampler_efficiency": round(e_sampler, 4),
        "stream_efficiency": round(e_stream, 4), "difference": round(e_stream - e_sampler, 4),
    }  # fmt: skip


def balance(quick: bool) -> list[dict]:
    rows = []
    traces = ("wlbllm", "sft") if quick else ("wlbllm", "prolong", "sft")
    for trace in traces:
        for topo_name in TOPOLOGIES:
            for seed in (0,) if quick else (0, 1, 2):
                row = balance_row(trace, topo_name, seed)
                print(row, flush=True)
                rows.append(row)
    return rows


# ---- throughput ------------------------------------------------------------------------------------------------
THROUGHPUT = {"docs": 3000, "files": 8, "max_tokens": 4096, "micro_batches": 4, "window_docs": 256, "reps": 3}


def write_parquet(folder: Path, n: int, files: int, seed: int) -> tuple[list[str], int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = load_trace("sft", n=n, seed=seed)
    rng = np.random.default_rng(seed)
    paths = []
    for i, part in enumerate(np.array_split(np.arange(n), files)):
        ids = [rng.integers(0, 256, int(lengths[d])).tolist() for d in part]
        path = folder / f"part-{i:02d}.parquet"
        pq.write_table(pa.table({"input_ids": ids, "doc": part.tolist()}), path)
        paths.append(str(path))
    return paths, int(lengths.sum())


def _greedy(ds, cap: int):
    """The plain loop: next-fit packing of this rank's rows up to `cap` tokens per micro-batch."""
    mb, used = [], 0
    for row in ds:
        n = len(row["input_ids"])
        if mb and used + n > cap:
            yield mb
            mb, used = [], 0
        mb.append(row)
        used += n
    if mb:
        yield mb


def _pass(kind: str, paths, topo, rank: int, world: int, cfg: dict) -> dict:
    import datasets
    from datasets.distributed import split_dataset_by_node

    from balancer.streaming import BalancedStream

    coll = balancer.PackedCollator()
    ds = datasets.load_dataset("parquet", data_files=paths, split="train", streaming=True)
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = batches = 0
    stats = None
    if kind == "stream":
        stream = BalancedStream(ds, topo, DEFAULT_COST, window_docs=cfg["window_docs"], overflow="split")
        source = stream
    else:
        source = _greedy(split_dataset_by_node(ds, rank=rank, world_size=world), topo.max_tokens * topo.cp)
    setup = time.perf_counter() - wall  # the stream's constructor creates its gloo group (a rendezvous)
    for mb in source:
        tokens += coll(mb)["num_tokens"]
        batches += 1
    if kind == "stream":
        stats = stream.stats()
    return {"kind": kind, "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "tokens": tokens,
            "micro_batches": batches, "stats": stats, "setup": setup}  # fmt: skip


def _model_rate(tokens: int, reps: int = 3) -> float:
    """Tokens/s of TINY_LLAMA forward + backward on one packed sequence of `tokens` tokens (sdpa, 1 thread)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from balancer.calibration.timing import TINY_LLAMA

    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa"))
    ids = torch.randint(0, cfg["vocab_size"], (1, tokens))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        best = min(best, time.perf_counter() - start)
    return tokens / best


def _throughput_rank(rank: int, world: int, paths, out: str, cfg: dict) -> None:
    import torch.distributed as dist

    topo = balancer.Topology(dp=world, micro_batches=cfg["micro_batches"], max_tokens=cfg["max_tokens"])
    runs = []
    for rep in range(cfg["reps"]):
        for kind in ("stream", "plain") if rep % 2 == 0 else ("plain", "stream"):
            dist.barrier()
            runs.append(_pass(kind, paths, topo, rank, world, cfg))
    dist.barrier()
    rate = _model_rate(cfg["max_tokens"]) if rank == 0 else None
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps({"runs": runs, "model_tokens_per_s": rate}))


def throughput(world: int = 4, cfg: dict = THROUGHPUT) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.dist import run_world

    with tempfile.TemporaryDirectory() as tmp:
        paths, total = write_parquet(Path(tmp), cfg["docs"], cfg["files"], 0)
        run_world(world, _throughput_rank, paths, tmp, cfg)
        ranks = [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(world)]
    reps = []
    for i in range(len(ranks[0]["runs"])):
        runs = [r["runs"][i] for r in ranks]
        assert sum(x["tokens"] for x in runs) == total, (runs[0]["kind"], sum(x["tokens"] for x in runs), total)
        slowest = max(x["wall"] for x in runs)
        reps.append(
            {
                "kind": runs[0]["kind"],
                "tokens_per_s": sum(x["tokens"] for x in runs) / slowest,
                "slowest_wall_s": slowest,
                "cpu_s": [round(x["cpu"], 3) for x in runs],
                "setup_s": [round(x["setup"], 3) for x in runs],
                "micro_batches": [x["micro_batches"] for x in runs],
                "stats": [x["stats"] for x in runs],
            }
        )
    med = {k: float(np.median([r["tokens_per_s"] for r in reps if r["kind"] == k])) for k in ("stream", "plain")}
    window_tokens = cfg["window_docs"] * total / cfg["docs"]
    peaks = [s["peak_buffered_tokens"] for r in reps if r["kind"] == "stream" for s in r["stats"]]
    model = ranks[0]["model_tokens_per_s"]
    return {
        "config": {**cfg, "world": world, "total_tokens": total},
        "repetitions": reps,
        "stream_tokens_per_s": round(med["stream"]),
        "plain_tokens_per_s": round(med["plain"]),
        "stream_over_plain": round(med["stream"] / med["plain"], 3),
        "model_tokens_per_s_per_rank": round(model),
        "stream_per_rank_over_model": round(med["stream"] / world / model, 2),
        "peak_buffered_tokens_max": int(max(peaks)),
        "window_tokens_mean": round(window_tokens),
        "peak_over_2_window_per_dp": round(max(peaks) / (2 * window_tokens / world), 3),
    }


def balance_table(rows: list[dict]) -> dict:
    """Per trace and topology: epoch efficiency (mean over seeds) of the sampler and the stream, worst difference."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["trace"], r["topology"]), []).append(r)
    out = []
    for (trace, topo), rs in groups.items():
        window = f"{rs[0]['docs']:,} / {rs[0]['window_docs']:,} ({rs[0]['stream_windows']})"
        mean = [round(sum(r[k] for r in rs) / len(rs), 4) for k in ("sampler_efficiency", "stream_efficiency")]
        out.append([trace, topo, window, *mean, round(min(r["difference"] for r in rs), 4)])
    worst = round(-min(r["difference"] for r in rows), 4)
    seeds = ", ".join(str(s) for s in sorted({r["seed"] for r in rows}))
    out.append([f"all rows, seeds {seeds}", "", "", "", "", f"worst shortfall {worst} (target <= 0.02)"])
    columns = ["trace", "topology", "documents / window (windows)", "sampler", "stream", "worst stream - sampler"]
    return table(columns, out)


def throughput_table(t: dict) -> dict:
    """The throughput figures as (figure, value) rows."""
    c, reps = t["config"], t["repetitions"]
    pairs = []
    for a, b in zip(reps[0::2], reps[1::2]):
        by = {a["kind"]: a, b["kind"]: b}
        pairs.append(f"{by['stream']['tokens_per_s'] / by['plain']['tokens_per_s']:.2f}")
    cpu = {k: float(np.median([x for r in reps if r["kind"] == k for x in r["cpu_s"]])) for k in ("stream", "plain")}
    counts = {k: next(r["micro_batches"] for r in reps if r["kind"] == k) for k in ("stream", "plain")}
    sent = [s["bytes_sent"] for r in reps if r["kind"] == "stream" for s in r["stats"]]
    rows = [
        ["setup", f"{c['docs']:,} documents ({c['total_tokens']:,} tokens, SFT mix) in {c['files']} Parquet files; "
         f"dp{c['world']} x M{c['micro_batches']} x {c['max_tokens']:,}; windows of {c['window_docs']} documents; "
         f"{c['reps']} paired alternating repetitions"],
        ["BalancedStream -> PackedCollator, tokens/s (median)", f"{t['stream_tokens_per_s']:,}"],
        ["split_dataset_by_node + greedy packing -> PackedCollator, tokens/s (median)", f"{t['plain_tokens_per_s']:,}"],
        ["stream / plain (medians; per pair)", f"{t['stream_over_plain']:.2f} ({', '.join(pairs)})"],
        ["process CPU s per rank and pass, stream / plain (medians)", f"{cpu['stream']:.2f} / {cpu['plain']:.2f}"],
        ["micro-batches per rank, stream / plain", f"{counts['stream']} / {counts['plain']}"],
        ["tiny Llama forward + backward, tokens/s per rank", f"{t['model_tokens_per_s_per_rank']:,}"],
        ["stream tokens/s per rank / model tokens/s", f"{t['stream_per_rank_over_model']:.1f}"],
        ["peak buffered tokens per rank / (2 x window tokens / dp)",
         f"{t['peak_buffered_tokens_max']:,} / {round(2 * t['window_tokens_mean'] / c['world']):,} = "
         f"{t['peak_over_2_window_per_dp']:.2f}"],
        ["bytes sent per rank and pass", f"{min(sent):,}-{max(sent):,}"],
    ]  # fmt: skip
    return table(["figure", "value"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "balance", "throughput"), default="all")
    ap.add_argument("--quick", action="store_true", help="one seed, two traces (a smoke run)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    suffix = "_quick" if args.quick else ""
    if args.part in ("all", "balance"):
        rows = balance(args.quick)
        worst = round(-min(r["difference"] for r in rows), 4)
        payload = {"balance": rows, "balance_worst_shortfall": worst, "tables": {"balance": balance_table(rows)}}
        print(write_result("streaming_balance" + suffix, payload, clock="none"))
    if args.part in ("all", "throughput"):
        cfg = {**THROUGHPUT, "docs": 600, "reps": 1} if args.quick else THROUGHPUT
        result = throughput(cfg=cfg)
        payload = {"throughput": result, "tables": {"throughput": throughput_table(result)}}
        print(payload["throughput"], flush=True)
        print(write_result("streaming_throughput" + suffix, payload, clock="wall+process_cpu"))


if __name__ == "__main__":
    main()
