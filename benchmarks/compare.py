"""Side-by-side: this toolkit against what users would pick instead (issue 6).

    .venv/bin/python benchmarks/compare.py            # full run, a few minutes on 2 cores
    .venv/bin/python benchmarks/compare.py --quick    # 20M tokens per distribution instead of 200M
    .venv/bin/python benchmarks/compare.py --suite peers2026 --peers balancer,balancer_slices
        # only the project's rows; every other peer's record reused from the stored run (checked: same documents,
        # seed, topologies), each record marked with the run it came from

For each length distribution (wlbllm, prolong, sft, heavy) and topology, every peer of benchmarks/peers.py (TRL BFD
packing + trainer dealing, multipack, verl, WLB-LLM, balancer) plans one epoch of the same documents with the same
topology, cost model and seed; `Plan.metrics()` (docs/design.md, "Metrics") scores them all. The predicted speedup is
TRL's sum of step times over the peer's (`step_time_total`): the speedup a user switching from TRL would see if the
cost model holds. max_tokens is the next power of two >= longest document / cp, tokens_per_step = 0.85 x capacity.

Corpus size: TRL's packing materialises every token (Arrow int32), so each distribution is a seeded random subset
(without replacement) of its trace holding at most `--tokens` tokens (200M; `--quick` 20M); every peer plans the
same subset.

TRL: trl.pack_dataset(strategy='bfd', seq_length=max_tokens*cp), datasets.map default batches of 1000; packed once
per seq_length per distribution, its measured time counted in every row's plan_seconds; rows shuffled by a seeded
RandomSampler, row i of a step -> rank i % dp; the last partial step's rows are split into dp*M micro-batches (with
fewer documents than dp*M, they and the step before are dealt over two steps).

Writes benchmarks/results/compare.json and compare.png (`--name` renames both) through
`_common.write_result` (wall clock: plan_seconds are perf_counter seconds; machine cores and load at start and end;
the command) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _render as tb
import peers  # noqa: E402
import peers_pkg  # noqa: E402
from _common import RESULTS, write_result  # noqa: E402 - measures the load at start on import

import balancer  # noqa: E402
from balancer.cli.options import MODELS  # noqa: E402
from balancer.data.traces import load_trace  # noqa: E402

DISTS = ("wlbllm", "prolong", "sft", "heavy")
DEFAULT_COST = ("default", 2 / 53000, 1.0)  # attention per causal pair, linear per token (equal at 53K tokens)
TOPOLOGIES = [
    dict(label="dp8 M4", dp=8, cp=1, pp=1, micro_batches=4, cost="default"),
    dict(label="dp4 cp8 M8", dp=4, cp=8, pp=1, micro_batches=8, cost="default"),
    dict(label="dp4 cp2 pp4 M8", dp=4, cp=2, pp=4, micro_batches=8, cost="default"),
    dict(label="dp64 cp4 M8", dp=64, cp=4, pp=1, micro_batches=8, cost="default"),
    dict(label="dp8 cp2 M4 llama2-7b", dp=8, cp=2, pp=1, micro_batches=4, cost="llama2-7b"),
    dict(label="dp8 cp2 M4 llama3-70b", dp=8, cp=2, pp=1, micro_batches=4, cost="llama3-70b"),
]
PEER_ORDER = ("trl", "multipack", "verl", "wlb", "balancer")
# --suite peers2026 (issue 31): cp = pp = 1, dp4/dp8 x 4/8 micro-batches, the package peers of peers_pkg.py added
TOPOLOGIES_2026 = [
    dict(label=f"dp{dp} M{m}", dp=dp, cp=1, pp=1, micro_batches=m, cost="default") for dp in (4, 8) for m in (4, 8)
]
PEER_ORDER_2026 = ("trl", "multipack", "verl", "wlb", "hf_rebalance", "verl_pkg", "balancer_slices", "balancer")
SUITES = {"default": (TOPOLOGIES, PEER_ORDER), "peers2026": (TOPOLOGIES_2026, PEER_ORDER_2026)}
TIE = 0.005  # within 0.5% (relative) of the best counts as tied-first
GOAL_SPEEDUP = 1.2


def cost_model(name: str) -> balancer.CostModel:
    if name == "default":
        return balancer.CostModel(attn_coef=DEFAULT_COST[1], linear_coef=DEFAULT_COST[2])
    return balancer.CostModel.from_model(**MODELS[name])


def corpus(name: str, max_tokens: int, seed: int) -> tuple[np.ndarray, int]:
    """A seeded random subset (no replacement) of the trace with at most `max_tokens` tokens; (lengths, full n)."""
    full = load_trace(name, seed=seed)
    perm = np.random.default_rng([seed, 6]).permutation(len(full))
    keep = int(np.searchsorted(np.cumsum(full[perm]), max_tokens, side="right"))
    return full[np.sort(perm[:keep])], len(full)


def next_pow2(x: int) -> int:
    return 1 << int(np.ceil(np.log2(max(1, x))))


def topology_for(lengths: np.ndarray, spec: dict) -> balancer.Topology:
    max_tokens = next_pow2(-(-int(lengths.max()) // spec["cp"]))
    return balancer.Topology(
        dp=spec["dp"], cp=spec["cp"], pp=spec["pp"], micro_batches=spec["micro_batches"], max_tokens=max_tokens
    )  # tokens_per_step: the default 0.85 x capacity


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_peer(fn, lengths, topo, cost, seed, budget_s, **kwargs) -> tuple[dict, object]:
    """Plan with one peer under a wall-clock budget; every failure becomes a status, never an omission."""
    rec: dict = {}
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    t0 = time.perf_counter()
    try:
        plan = fn(lengths, topo, cost, seed=seed, **kwargs)
    except _Timeout:
        return {"status": f"failed: too slow (> {budget_s:.0f} s)"}, None
    except MemoryError as e:
        return {"status": f"failed: out of memory ({e})"}, None
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result
        return {"status": f"failed: {type(e).__name__}: {e}"}, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    rec["wall_seconds"] = time.perf_counter() - t0
    m = plan.metrics()
    try:
        plan.validate()
        status = "ok" if m["dropped_tokens"] == 0 else "drops data"
    except ValueError as e:
        status = "drops data" if m["dropped_tokens"] > 0 and "not in the plan" in str(e) else f"invalid: {e}"
    tok = plan.micro_batch_tokens().sum(axis=(1, 2)).astype(np.float64)
    dev = np.abs(tok[:-1] - topo.tokens_per_step) / topo.tokens_per_step if len(tok) > 1 else np.zeros(0)
    rec.update(
        status=status,
        **{
            k: m[k]
            for k in (
                "steps",
                "imbalance",
                "worst_step",
                "epoch_efficiency",
                "dropped_tokens",
                "plan_seconds",
                "mean_delay_steps",
                "token_utilization",
                "step_time_total",
                "lower_bound_epoch",
            )
        },
        max_step_token_dev=float(dev.max()) if len(dev) else 0.0,
        last_step_tokens=int(tok[-1]) if len(tok) else 0,
        notes=getattr(plan, "peer_notes", {}),
    )
    return rec, plan


def rank_row(row: dict) -> None:
    """Mark the best imbalance / epoch_efficiency among valid plans and whether balancer is first or tied."""
    valid = {p: r for p, r in row["peers"].items() if r["status"] == "ok"}
    if not valid:
        return
    best_imb = min(r["imbalance"] for r in valid.values())
    best_eff = max(r["epoch_efficiency"] for r in valid.values())
    row["best_imbalance"] = [p for p, r in valid.items() if r["imbalance"] <= best_imb * (1 + TIE)]
    row["best_efficiency"] = [p for p, r in valid.items() if r["epoch_efficiency"] >= best_eff * (1 - TIE)]
    b = row["peers"].get("balancer", {})
    row["balancer_first_imbalance"] = "balancer" in row["best_imbalance"]
    row["balancer_first_efficiency"] = "balancer" in row["best_efficiency"]
    row["balancer_zero_drop"] = b.get("dropped_tokens", 1) == 0 and b.get("status") == "ok"


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    head = (
        "| distribution | topology | peer | status | imbalance | worst_step | epoch_eff | dropped tok | "
        "plan s | steps | max step tok dev | speedup vs TRL |\n"
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for row in rows:
        for p in row["peers"]:
            r = row["peers"][p]
            ok = "imbalance" in r
            imb = fmt(r.get("imbalance")) if ok else "-"
            eff = fmt(r.get("epoch_efficiency")) if ok else "-"
            if p in row.get("best_imbalance", []):
                imb = f"**{imb}**"
            if p in row.get("best_efficiency", []):
                eff = f"**{eff}**"
            status = r["status"] if len(r["status"]) < 60 else r["status"][:57] + "..."
            lines.append(
                f"| {row['distribution']} | {row['topology']} | {p} | {status} | {imb} | "
                f"{fmt(r.get('worst_step'), '.2f')} | {eff} | {r.get('dropped_tokens', '-')} | "
                f"{fmt(r.get('plan_seconds'), '.2f')} | {r.get('steps', '-')} | "
                f"{fmt(r.get('max_step_token_dev'), '.1%')} | {fmt(r.get('speedup_vs_trl'), '.2f')}x |"
            )
    return head + "\n".join(lines) + "\n"


def summary_markdown(rows: list[dict]) -> str:
    peers_ = PEER_ORDER[1:]
    head = (
        "| distribution | topology | "
        + " | ".join(f"{p} speedup" for p in peers_)
        + " | bound | balancer first (imb / eff) |\n|---|---|"
        + "---:|" * (len(peers_) + 1)
        + "---|\n"
    )
    lines = []
    for row in rows:
        cells = []
        for p in peers_:
            r = row["peers"][p]
            cells.append(fmt(r.get("speedup_vs_trl"), ".2f") + "x" if r.get("speedup_vs_trl") else r["status"][:20])
        first = (
            ("yes" if row.get("balancer_first_imbalance") else "no")
            + " / "
            + ("yes" if row.get("balancer_first_efficiency") else "no")
        )
        lines.append(
            f"| {row['distribution']} | {row['topology']} | "
            + " | ".join(cells)
            + f" | {fmt(row.get('speedup_bound'), '.2f')}x | {first} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers_ = PEER_ORDER[1:]
    colors = {"multipack": "#9aa5b1", "verl": "#7fb3d5", "wlb": "#f5b041", "balancer": "#1e8449"}
    dists = [d for d in DISTS if any(r["distribution"] == d for r in rows)]
    fig, axes = plt.subplots(len(dists), 1, figsize=(13, 3.6 * len(dists)), squeeze=False)
    width = 0.8 / len(peers_)
    for ax, dist in zip(axes[:, 0], dists):
        drows = [r for r in rows if r["distribution"] == dist]
        x = np.arange(len(drows))
        top = 1.0
        for i, p in enumerate(peers_):
            vals = [r["peers"][p].get("speedup_vs_trl") for r in drows]
            h = [v if v is not None else 0.0 for v in vals]
            bars = ax.bar(
                x + (i - (len(peers_) - 1) / 2) * width,
                h,
                width,
                label=p,
                color=colors[p],
                edgecolor="black",
                linewidth=0.4,
            )
            for b, v, r in zip(bars, vals, drows):
                st = r["peers"][p]["status"]
                if v is None or st != "ok":
                    tag = "failed" if v is None else ("drops data" if st == "drops data" else "invalid plan")
                    ax.text(
                        b.get_x() + b.get_width() / 2,
                        (v or 0) + 0.03,
                        tag,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="red",
                        rotation=90,
                    )
                elif p == "balancer":
                    ax.text(
                        b.get_x() + b.get_width() / 2,
                        v + 0.03,
                        f"{v:.2f}",
                        ha="center",
                        va="bottom",
                        fontsize=8,
                        fontweight="bold",
                    )
            top = max([top] + [v for v in vals if v is not None])
        ax.axhline(1.0, color="black", linewidth=1.0, label="TRL BFD (= 1.0)")
        ax.axhline(GOAL_SPEEDUP, color="red", linewidth=0.8, linestyle="--", label=f"goal {GOAL_SPEEDUP}x")
        ax.set_xticks(x)
        ax.set_xticklabels([r["topology"] for r in drows], fontsize=9)
        ax.set_ylim(0, top * 1.18)
        ax.set_ylabel("predicted speedup vs TRL")
        n = drows[0]["num_docs"]
        ax.set_title(f"{dist}: {n:,} documents, {drows[0]['tokens'] / 1e6:.0f}M tokens", fontsize=11, loc="left")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=12, y=0.995)
    fig.legend(handles, labels, ncol=6, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, 0.975), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96 if len(dists) > 1 else 0.86))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_reused(args, run_now: set, peer_order) -> dict | None:
    """The stored results whose records the peers not run now take (None when every peer runs)."""
    if run_now >= set(peer_order):
        return None
    path = Path(args.reuse) if args.reuse else RESULTS / f"{args.name}.json"
    data = json.loads(path.read_text())
    data["path"] = path
    return data


def _check_reused_corpus(reused: dict, dist: str, mine: dict, budget_tokens: int, seed: int) -> None:
    """Reused peers must have planned the same documents: same seed, token budget and corpus."""
    cfg = reused["config"]
    theirs = cfg["corpora"].get(dist)
    if (
        cfg["seed"] != seed
        or cfg["tokens_per_distribution"] != budget_tokens
        or theirs is None
        or any(theirs[k] != mine[k] for k in ("num_docs", "tokens", "max_length"))
    ):
        raise SystemExit(f"compare.py: --reuse {reused['path']}: not a run of the same {dist} documents and seed")


def _slice_steps(stored: dict | None, row: dict, run_now: set) -> int:
    """The step count the count-based peers cut their fixed slices from: that of the reused run when one of them is
    reused (its `slices_from_steps`, recorded since that field exists, else that run's balancer steps), so every
    slice peer of a row sees the same slices; else this run's balancer steps."""
    if stored is not None:
        for q in peers_pkg.PKG_PEERS:
            if q not in run_now and "slices_from_steps" in stored["peers"].get(q, {}):
                return int(stored["peers"][q]["slices_from_steps"])
    return (stored or row)["peers"]["balancer"].get("steps") or 1


def _reused_row(reused: dict, dist: str, label: str, topo) -> dict:
    for row in reused["rows"]:
        if row["distribution"] == dist and row["topology"] == label and row["topology_spec"] == topo.to_dict():
            return row
    raise SystemExit(f"compare.py: --reuse {reused['path']}: has no row {dist} / {label} for this topology")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20M tokens per distribution (default 200M)")
    ap.add_argument(
        "--tokens",
        type=float,
        default=None,
        help="tokens per distribution (overrides --quick; default 200M, 100M with --suite peers2026)",
    )
    ap.add_argument("--dists", default=",".join(DISTS), help="comma-separated distributions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds one peer may take on one input")
    ap.add_argument("--name", default=None, help="result name: benchmarks/results/NAME.json and NAME.png")
    suites = "default: the 24 rows against TRL; peers2026: cp = pp = 1 against the package peers"
    ap.add_argument("--suite", choices=sorted(SUITES), default="default", help=suites)
    ap.add_argument(
        "--peers",
        default=None,
        help="comma-separated peers to run now (default: all); the others' records are reused from --reuse, "
        "which must be a run of the same documents, seed and topologies",
    )
    ap.add_argument("--reuse", default=None, help="results JSON to reuse (default: the stored NAME.json)")
    ap.add_argument(
        "--seeds",
        default=None,
        help="peers2026 only: comma-separated seeds; the equal-slices comparison (balancer_slices against "
        f"{', '.join(peers_pkg.SLICE_PEERS)}, all re-run) on each, mean and worst per row "
        "(writes NAME_seeds.json; no reuse)",
    )
    args = ap.parse_args(argv)
    if args.seeds is not None:
        return main_seeds(args)
    topologies, peer_order = SUITES[args.suite]
    args.name = args.name or ("compare" if args.suite == "default" else "compare_peers")
    run_now = set(peer_order) if args.peers is None else set(args.peers.split(","))
    unknown = run_now - set(peer_order)
    if unknown:
        known = ", ".join(peer_order)
        print(f"compare.py: --peers: unknown peer(s) {sorted(unknown)}; known: {known}", file=sys.stderr)
        return 2
    reused = _load_reused(args, run_now, peer_order)
    full = 200e6 if args.suite == "default" else 100e6  # peers2026: 16 rows x 8 peers, 100M tokens per distribution
    budget_tokens = int(args.tokens if args.tokens else (20e6 if args.quick else full))
    png = RESULTS / f"{args.name}.png"
    t_start = time.perf_counter()
    rows: list[dict] = []
    corpora = {}
    for dist in args.dists.split(","):
        lengths, n_full = corpus(dist, budget_tokens, args.seed)
        corpora[dist] = dict(
            num_docs=int(len(lengths)),
            trace_docs=int(n_full),
            tokens=int(lengths.sum()),
            max_length=int(lengths.max()),
            median_length=float(np.median(lengths)),
        )
        if reused is not None:
            _check_reused_corpus(reused, dist, corpora[dist], budget_tokens, args.seed)
        print(
            f"== {dist}: {len(lengths):,} of {n_full:,} documents, {lengths.sum() / 1e6:.0f}M tokens, "
            f"max {lengths.max():,}",
            flush=True,
        )
        trl_cache: dict[int, object] = {}
        for spec in topologies:
            topo = topology_for(lengths, spec)
            cost = cost_model(spec["cost"])
            row = dict(
                distribution=dist,
                topology=spec["label"],
                cost=spec["cost"],
                topology_spec=topo.to_dict(),
                num_docs=int(len(lengths)),
                tokens=int(lengths.sum()),
                peers={},
            )
            seq = topo.micro_batch_tokens
            stored = _reused_row(reused, dist, spec["label"], topo) if reused is not None else None
            if "trl" in run_now and seq not in trl_cache:  # seq_length = max_tokens * cp: pack once per value
                t0 = time.perf_counter()
                try:
                    order = peers.shuffled_order(len(lengths), args.seed)
                    trl_cache[seq] = peers.trl_pack(lengths, seq, order)
                except MemoryError as e:
                    trl_cache[seq] = f"failed: out of memory ({e})"
                except Exception as e:  # noqa: BLE001
                    trl_cache[seq] = f"failed: {type(e).__name__}: {e}"
                print(f"   trl.pack_dataset(seq_length={seq:,}): {time.perf_counter() - t0:.1f} s", flush=True)
            # the project first: the count-based peers of peers_pkg get as many steps as its plan has
            for p in ("balancer",) + tuple(q for q in peer_order if q != "balancer"):
                if p not in run_now:  # the stored run's record, marked with that run
                    row["peers"][p] = dict(stored["peers"][p], run=stored["peers"][p].get("run", reused["date"]))
                    continue
                if p in peers_pkg.PKG_PEERS:
                    # the slices of the count-based peers follow balancer's step count; with reused peers, that of
                    # the run they came from, so that balancer_slices sees their slices
                    steps = _slice_steps(stored, row, run_now)
                    rec, _ = run_peer(peers_pkg.PKG_PEERS[p], lengths, topo, cost, args.seed, args.budget, steps=steps)
                    rec["slices_from_steps"] = steps
                elif p == "trl":
                    if isinstance(trl_cache[seq], str):
                        rec = {"status": trl_cache[seq]}
                    else:
                        rec, _ = run_peer(
                            peers.trl_plan, lengths, topo, cost, args.seed, args.budget, packed=trl_cache[seq]
                        )
                else:
                    rec, _ = run_peer(peers.PEERS[p], lengths, topo, cost, args.seed, args.budget)
                row["peers"][p] = dict(rec, run="this run")
            row["peers"] = {p: row["peers"][p] for p in peer_order}
            if args.suite == "peers2026":
                peers_pkg.score_row(row)
            base = row["peers"]["trl"].get("step_time_total")
            lb = row["peers"]["balancer"].get("lower_bound_epoch")
            row["speedup_bound"] = base / lb if base and lb else None  # TRL time / LB_epoch: no plan beats it
            for r in row["peers"].values():
                r["speedup_vs_trl"] = (base / r["step_time_total"]) if base and r.get("step_time_total") else None
            rank_row(row)
            rows.append(row)
            b, t = row["peers"]["balancer"], row["peers"]["trl"]
            print(
                f"   {spec['label']:<24} max_tokens={topo.max_tokens:>7}  "
                + "  ".join(f"{p}:{fmt(row['peers'][p].get('imbalance'), '.3f')}" for p in peer_order)
                + f"  speedup={fmt(b.get('speedup_vs_trl'), '.2f')}x  trl_steps={t.get('steps')}",
                flush=True,
            )
    runtime = time.perf_counter() - t_start

    goal_rows = [
        r
        for r in rows
        if r["distribution"] in ("wlbllm", "prolong", "heavy")
        and (r["topology_spec"]["cp"] > 1 or r["topology_spec"]["pp"] > 1)
    ]
    goal = dict(
        balancer_first_imbalance_all=all(r.get("balancer_first_imbalance") for r in rows),
        balancer_first_efficiency_all=all(r.get("balancer_first_efficiency") for r in rows),
        balancer_zero_drop_all=all(r.get("balancer_zero_drop") for r in rows),
        speedup_rows=len(goal_rows),
        speedup_min=min((r["peers"]["balancer"].get("speedup_vs_trl") or 0.0) for r in goal_rows)
        if goal_rows
        else None,
        speedup_ge_goal_all=all(
            (r["peers"]["balancer"].get("speedup_vs_trl") or 0.0) >= GOAL_SPEEDUP for r in goal_rows
        ),
        not_first_imbalance=[
            f"{r['distribution']} / {r['topology']}" for r in rows if not r.get("balancer_first_imbalance")
        ],
        not_first_efficiency=[
            f"{r['distribution']} / {r['topology']}" for r in rows if not r.get("balancer_first_efficiency")
        ],
    )
    result = dict(
        config=dict(
            quick=args.quick,
            tokens_per_distribution=budget_tokens,
            seed=args.seed,
            budget_s=args.budget,
            tie_tolerance=TIE,
            goal_speedup=GOAL_SPEEDUP,
            default_cost=dict(attn_coef=DEFAULT_COST[1], linear_coef=DEFAULT_COST[2]),
            models={k: MODELS[k] for k in ("llama2-7b", "llama3-70b")},
            corpora=corpora,
        ),
        runtime_seconds=runtime,
        goal=goal,
        rows=rows,
    )
    if reused is not None:
        # peers the stored run had itself reused come from the run it named (the origin travels along)
        origin = (
            reused.get("reused")
            if set(reused.get("reused", {}).get("peers", ())) >= {p for p in peer_order if p not in run_now}
            else None
        )
        src = origin or dict(reused, path=os.path.relpath(reused["path"], HERE.parent))
        result["reused"] = dict(
            path=src["path"], date=src["date"], command=src["command"],
            machine=src["machine"], runtime_seconds=src.get("runtime_seconds"),
            peers=[p for p in peer_order if p not in run_now], run_now=[p for p in peer_order if p in run_now],
        )  # fmt: skip
    if args.suite == "peers2026":
        result["goal"] = dict(
            goal_ratio=peers_pkg.GOAL_RATIO,
            rows=len(rows),
            met_all=all(r["goal_met"] for r in rows),
            not_met=[f"{r['distribution']} / {r['topology']}: {r['ratio']:.0%}" for r in rows if not r["goal_met"]],
            worst_ratio=max((r["ratio"] for r in rows if r["ratio"] is not None), default=None),
            zero_drop_all=all(r["zero_drop"] for r in rows),
        )
        goal = result["goal"]
    out = write_result(args.name, result, clock="wall")  # plan_seconds and runtime: perf_counter
    print()
    if args.suite == "peers2026":
        print(peers_pkg.excess_markdown(rows))
    else:
        plot(
            rows,
            png,
            "Predicted training speedup over TRL BFD packing (sum of step times, compute cost model); higher is better",
        )
        print(summary_markdown(rows))
    print(markdown(rows))
    print(f"goal: {json.dumps(goal)}")
    print(f"wrote {out}{'' if args.suite == 'peers2026' else f' and {png}'} in {runtime:.0f} s")
    return 0


def main_seeds(args) -> int:
    """--seeds: per seed, every row's fixed slices planned by the slice peers and balancer_slices (the count-based
    peers cut their slices from the whole-epoch plan's step count, so balancer runs too); the ratio of
    balancer_slices' excess over the epoch bound to the best slice peer's, its mean and worst over the seeds."""
    if args.suite != "peers2026":
        raise SystemExit("compare.py: --seeds is for --suite peers2026")
    seeds = [int(x) for x in args.seeds.split(",")]
    names = ("balancer",) + peers_pkg.SLICE_PEERS + ("balancer_slices",)
    budget_tokens = int(args.tokens if args.tokens else (20e6 if args.quick else 100e6))
    t_start = time.perf_counter()
    runs = []
    for seed in seeds:
        for dist in args.dists.split(","):
            lengths, _ = corpus(dist, budget_tokens, seed)
            for spec in TOPOLOGIES_2026:
                topo, cost = topology_for(lengths, spec), cost_model(spec["cost"])
                row = dict(seed=seed, distribution=dist, topology=spec["label"], num_docs=int(len(lengths)), peers={})
                row["peers"]["balancer"], _ = run_peer(peers.PEERS["balancer"], lengths, topo, cost, seed, args.budget)
                steps = row["peers"]["balancer"].get("steps", 1)
                for p in names[1:]:
                    rec, _ = run_peer(peers_pkg.PKG_PEERS[p], lengths, topo, cost, seed, args.budget, steps=steps)
                    row["peers"][p] = dict(rec, slices_from_steps=steps)
                peers_pkg.score_row(row)
                runs.append(row)
                print(f"   seed {seed} {dist} {spec['label']}: slices / best slice peer = {row['slices_ratio']}",
                      flush=True)  # fmt: skip
    rows = peers_pkg.seed_summary(runs)
    result = dict(
        config=dict(suite=args.suite, seeds=seeds, tokens_per_distribution=budget_tokens, budget_s=args.budget),
        runtime_seconds=time.perf_counter() - t_start,
        goal=dict(
            goal_ratio=peers_pkg.GOAL_RATIO,
            rows=len(rows),
            met_all=all(r["goal_met"] for r in rows),
            not_met=[
                f"{r['distribution']} / {r['topology']}: worst {r['worst']:.0%}" for r in rows if not r["goal_met"]
            ],
            worst_ratio=max((r["worst"] for r in rows if r["worst"] is not None), default=None),
        ),
        rows=rows,
        runs=runs,
    )
    out = write_result(f"{args.name or 'compare_peers'}_seeds", result, clock="wall")
    print(peers_pkg.seeds_markdown(rows))
    print(f"goal: {json.dumps(result['goal'])}")
    print(f"wrote {out} in {result['runtime_seconds']:.0f} s")
    return 0


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_compare_speedup() -> str:
    data = tb.load("compare")
    peers = ["multipack", "verl", "wlb", "balancer"]
    rows = []
    for row in data["rows"]:
        cells = []
        for peer in peers:
            result = row["peers"][peer]
            speedup = result.get("speedup_vs_trl")
            cells.append(f"{speedup:.2f}x" if speedup else str(result.get("status", "-"))[:20])
        first = f"{tb.fmt(row.get('balancer_first_imbalance'))} / {tb.fmt(row.get('balancer_first_efficiency'))}"
        rows.append(
            [row["distribution"], row["topology"], *cells, f"{tb.fmt(row.get('speedup_bound'), '.2f')}x", first]
        )
    header = ["distribution", "topology", *[f"{p} speedup" for p in peers], "bound", "balancer first (imb / eff)"]
    return tb.markdown(header, rows) + tb.record_line(data)


def table_compare_peers() -> str:
    """The 2026 suite: every peer's excess over the epoch bound, the project's, its per-step bound, the ratios."""
    data = tb.load("compare_peers")
    project = ("balancer", "balancer_slices")
    names = [p for p in data["rows"][0]["peers"] if p not in project]
    rows = []
    for row in data["rows"]:
        cells = []
        for p in names:
            rec = row["peers"][p]
            cell = tb.pct(rec.get("excess_epoch")) if rec.get("status") == "ok" else str(rec.get("status"))[:24]
            if rec.get("notes", {}).get("over_cap_micro_batches"):
                cell += "*"
            cells.append(f"**{cell}**" if p == row.get("best_peer") else cell)
        ratio = "-" if row.get("ratio") is None else f"{row['ratio']:.0%}"
        sratio = "-" if row.get("slices_ratio") is None else f"{row['slices_ratio']:.0%}"
        rows.append([row["distribution"], row["topology"], *cells, tb.pct(row["peers"]["balancer"].get("excess_epoch")),
                     tb.pct(row.get("step_bound_excess")), ratio,
                     tb.pct(row["peers"]["balancer_slices"].get("excess_epoch")), sratio])  # fmt: skip
    header = ["distribution", "topology", *names, "balancer", "of it: per-step bound", "balancer / best peer",
              "balancer_slices", "slices / best slice peer"]  # fmt: skip
    goal = data["goal"]
    verdict = f"met on all {goal['rows']}" if goal["met_all"] else f"missed on {len(goal['not_met'])} of {goal['rows']}"
    note = (
        "\n\nTwo comparisons side by side: **balancer** plans the whole epoch (it may move a document to another "
        "step) against every peer; **balancer_slices** plans each of the peers' own fixed global batches as given "
        "(`balance_batch` per batch), the like-for-like comparison with the peers that take a batch as given "
        "(hf_rebalance, verl_pkg: **slices / best slice peer**)."
        f"\n\nGoal (balancer's excess <= {goal['goal_ratio']:.0%} of the best peer's on every row): {verdict} rows"
        f"; nothing dropped by any valid plan: {tb.fmt(goal['zero_drop_all'])}. * = the plan has micro-batches above "
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
    return tb.markdown(header, rows) + note + tb.record_line(data)


def table_compare_all() -> str:
    data = tb.load("compare")
    rows = []
    for row in data["rows"]:
        for peer, result in row["peers"].items():
            rows.append(
                [
                    row["distribution"],
                    row["topology"],
                    peer,
                    tb.fmt(result.get("imbalance"), ".4f"),
                    tb.fmt(result.get("epoch_efficiency"), ".4f"),
                    tb.fmt(result.get("worst_step")),
                    tb.fmt(result.get("steps"), "d"),
                    tb.fmt(result.get("dropped_tokens"), "d"),
                    tb.fmt(result.get("plan_seconds"), ".2f"),
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
    return tb.markdown(header, rows)


def _mean_pct(values: list) -> str:
    return "-" if not values or any(v is None for v in values) else tb.pct(float(np.mean(values)))


def table_compare_peers_seeds(record: str = "compare_peers_seeds") -> str:
    """--seeds: the equal-slices comparison per row, mean and worst over the seeds (from `record`)."""
    data = tb.load(record)
    rows = []
    for r in data["rows"]:
        per_seed = ", ".join("-" if x is None else f"{x:.0%}" for x in r["ratios"])
        peers_ = sorted(set(p for p in r["best_slice_peer"] if p))
        ratio = ["-" if x is None else f"{x:.0%}" for x in (r["mean"], r["worst"])]
        # the slices' floor, from the runs (a record written before it was a field of the rows has the runs)
        mine = [x for x in data["runs"] if (x["distribution"], x["topology"]) == (r["distribution"], r["topology"])]
        floor = peers_pkg.floor_summary(mine)
        worst_floor = "-" if floor["floor_worst"] is None else f"{floor['floor_worst']:.0%}"
        rows.append([r["distribution"], r["topology"], _mean_pct(r["slices_excess"]),
                     _mean_pct(floor["floor_excess"]), _mean_pct(r["best_slice_peer_excess"]), ", ".join(peers_),
                     per_seed, *ratio, worst_floor])  # fmt: skip
    header = ["distribution", "topology", "balancer_slices (mean)", "slices' floor (mean)",
              "best slice peer (mean)", "best slice peer", "ratio per seed", "ratio mean", "ratio worst",
              "floor / best peer (worst)"]  # fmt: skip
    goal, cfg = data["goal"], data["config"]
    verdict = f"met on all {goal['rows']}" if goal["met_all"] else f"missed on {len(goal['not_met'])} of {goal['rows']}"
    note = (
        f"\n\nSeeds {', '.join(map(str, cfg['seeds']))}, {cfg['tokens_per_distribution'] / 1e6:.0f}M tokens per "
        f"distribution per seed, every column re-run in this run. Goal (balancer_slices' excess <= "
        f"{goal['goal_ratio']:.0%} of the best slice peer's on every row, worst over the seeds): {verdict} rows. "
        "The slices' floor is the excess no plan of the same fixed slices goes under (every step at its own bound: "
        "the heaviest document or the mean work per rank); where the floor alone is over the goal's share of the "
        "best peer's excess (last column), no planner of those slices meets the goal on that row."
    )
    return tb.markdown(header, rows) + note + tb.record_line(data)


TABLES = {  # docs/ marker name -> the table, from the record
    "compare_speedup": table_compare_speedup,
    "compare_all": table_compare_all,
    "compare_peers": table_compare_peers,
    "compare_peers_seeds": table_compare_peers_seeds,
    "compare_heavy_seeds": lambda: table_compare_peers_seeds("compare_heavy_seeds"),  # --dists heavy --name
}


if __name__ == "__main__":
    sys.exit(main())
