"""The project's dynamic-CP plan beside megatron-core 0.19.2's hybrid-CP scheduler on the same documents.

Question: on the same step documents and the same DP x CP pool (PP 1: Megatron's hybrid CP asserts it), how far
above the step lower bound does each schedule run, how many pad tokens and micro-batches does it need, and how long
does it take to plan?

- The project: `balancer.plan` with `cp_sizes` = every power of two dividing the pool (the sizes Megatron's hybrid
  CP can form), `max_tokens` = the next power of two >= longest document / pool, steps of 85% of the capacity.
- Megatron: `BalancedCPScheduler.get_groups_and_subsamples` (megatron/core/pipeline_parallel/hybrid_cp_schedule.py)
  driven as its `HybridCPDataLoaderWrapper` drives it: every document of the step as `(id, length)`,
  `max_seq_len_per_rank` = the same `max_tokens`, the DP x CP group of the pool's size (torch's fake process group:
  the scheduler reads only its size; the wrapper itself calls `.cuda()`). Its execution is modelled as its
  `hybrid_context_parallel_forward_backward` runs it: every rank runs its sub-samples of a group in order, one
  micro-batch each, a sub-sample shared by k ranks starting when all k reach it (CP k), a barrier over the pool at
  the end of every group.
- One cost for both (`_common.DEFAULT_COST`: attention pairs + tokens; no per-micro-batch overhead, which would
  only add to Megatron's one-micro-batch-per-document schedule) and one time model: a group of size c runs its
  documents in cost / c; the project's plan runs slot after slot, a group starting when its ranks finished their
  previous slot (no barrier), checked against `Plan.metrics()`.
- Bound per step (the same documents for both): max(W / pool, max_d cost(d) / pool); excess = sum of step times /
  sum of bounds - 1.
- Pad tokens: Megatron's hybrid CP zigzags each sub-sample shared by k > 1 ranks over the whole sequence, so its
  length is padded to a multiple of 2k; the project's hybrid layout pads nothing; through
  `balancer.integrations.megatron` in Megatron's per-document zigzag every document of a group of size c > 1 is
  padded to 2c (also reported).
- Planning time: process CPU seconds, project (the whole epoch) and Megatron (every step) alternating, `--reps`
  pairs, medians.

    python benchmarks/megatron_schedulers.py            # writes benchmarks/results/megatron_schedulers.json
    python benchmarks/tables.py                         # the table in docs/megatron.md
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import numpy as np
from _common import DEFAULT_COST, table, write_result

import balancer
from balancer.data.traces import load_trace

POOLS = {"pool8 (dp8, M=4)": (8, 4), "pool32 (dp4 x cp8, M=8)": (32, 8)}
FILL = 0.85


def topology(lengths: np.ndarray, pool: int, m: int) -> balancer.Topology:
    max_tokens = 1 << int(np.ceil(np.log2(-(-int(lengths.max()) // pool))))
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= pool and pool % s == 0)
    return balancer.Topology(
        dp=pool, cp=1, micro_batches=m, max_tokens=max_tokens,
        tokens_per_step=int(FILL * pool * m * max_tokens), cp_sizes=sizes,
    )  # fmt: skip


def cost(tokens) -> np.ndarray:
    t = np.asarray(tokens, dtype=np.float64)
    return DEFAULT_COST.attn_coef * t * (t + 1) / 2 + DEFAULT_COST.linear_coef * t


# ---- running a schedule ------------------------------------------------------------------------------------------
def run_queues(queues: list[list[tuple[tuple[int, ...], float]]], finish: np.ndarray) -> np.ndarray:
    """Every rank runs its queue of (member ranks, seconds) in order; a unit starts when all its members reach it
    (they must all list it next). Returns the finish times; a schedule that could deadlock raises."""
    heads = [0] * len(queues)
    left = sum(len(q) for q in queues)
    while left:
        ran = False
        for r, q in enumerate(queues):
            if heads[r] == len(q):
                continue
            members, seconds = q[heads[r]]
            if all(heads[x] < len(queues[x]) and queues[x][heads[x]][0] == members for x in members):
                start = finish[list(members)].max()
                for x in members:
                    finish[x] = start + seconds
                    heads[x] += 1
                left -= len(members)
                ran = True
        if not ran:
            raise RuntimeError("the schedule deadlocks: ranks wait for each other")
    return finish


def megatron_step(lengths: np.ndarray, docs: list[int], scheduler, pool: int) -> dict:
    """Megatron's hybrid-CP schedule of one step: its time, pad tokens, micro-batches per rank, CPU seconds."""
    cpu = time.process_time()
    _, sample_id_groups = scheduler.get_groups_and_subsamples([(d, int(lengths[d])) for d in docs], None)
    seconds = time.process_time() - cpu
    total, pad, counts, placed = 0.0, 0, np.zeros(pool, dtype=np.int64), set()
    for group in sample_id_groups:
        owners: dict[int, list[int]] = {}
        for r, ids in enumerate(group):
            for d in ids:
                owners.setdefault(d, []).append(r)
        queues = []
        for r in range(pool):
            queues.append([(tuple(owners[d]), float(cost(lengths[d])) / len(owners[d])) for d in group[r]])
            counts[r] += len(group[r])
        for d, members in owners.items():
            k = len(members)
            pad += 0 if k == 1 else int(-lengths[d] % (2 * k))
            placed.add(d)
        total += float(run_queues(queues, np.zeros(pool)).max())  # a barrier over the pool ends every group
    assert placed == set(docs), "Megatron's schedule lost or invented documents"
    return {"time": total, "pad": pad, "micro_batches": counts, "cpu": seconds}


def project_step(step, lengths: np.ndarray, pool: int) -> dict:
    """The project's dynamic plan of one step: its time (slot model), pad tokens per layout, micro-batches."""
    queues: list[list] = [[] for _ in range(pool)]
    pad_zigzag = pad_sequence = 0
    for slot in step.slots:
        for g in slot.groups:
            start, size = g.ranks
            if g.spans or g.fillers:
                raise RuntimeError("a document split over micro-batches: not comparable with Megatron's schedule")
            members = tuple(range(start, start + size))
            for r in members:
                queues[r].append((members, float(cost(lengths[g.docs]).sum()) / size))
            if size > 1:
                pad_zigzag += int((-lengths[g.docs] % (2 * size)).sum())
                pad_sequence += int(-lengths[g.docs].sum() % (2 * size))
    t = float(run_queues(queues, np.zeros(pool)).max())
    docs = [d for slot in step.slots for g in slot.groups for d in g.docs]
    return {"time": t, "pad_zigzag": pad_zigzag, "pad_sequence": pad_sequence, "docs": docs,
            "micro_batches": len(step.slots)}  # fmt: skip


def bound(lengths: np.ndarray, docs: list[int], pool: int) -> float:
    c = cost(lengths[docs])
    return max(float(c.sum()) / pool, float(c.max()) / pool)


# ---- one row -------------------------------------------------------------------------------------------------------
def megatron_scheduler(max_tokens: int, pool: int):
    """A fresh `BalancedCPScheduler` for a pool of `pool` ranks (fake process group of that size)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and dist.get_world_size() != pool:
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pool)
    return BalancedCPScheduler(max_seq_len_per_rank=max_tokens, dp_cp_group=dist.group.WORLD)


def run_pair(lengths: np.ndarray, topo: balancer.Topology, pool: int) -> tuple:
    """One paired rep: the project's epoch plan and Megatron's schedule of every step (CPU seconds each)."""
    cpu = time.process_time()
    plan = balancer.plan(lengths, topo, DEFAULT_COST, seed=0)
    plan_cpu = time.process_time() - cpu
    ours = [project_step(s, lengths, pool) for s in plan.steps]
    scheduler = megatron_scheduler(topo.max_tokens, pool)
    theirs = [megatron_step(lengths, o["docs"], scheduler, pool) for o in ours]
    return plan, ours, theirs, plan_cpu, sum(t["cpu"] for t in theirs)


def row(trace: str, name: str, pool: int, m: int, reps: int) -> dict:
    lengths = load_trace(trace)
    topo = topology(lengths, pool, m)
    plan_cpu, meg_cpu = [], []
    for _ in range(reps):
        plan, ours, theirs, a, b = run_pair(lengths, topo, pool)
        plan_cpu.append(a)
        meg_cpu.append(b)
    placed = sorted(d for o in ours for d in o["docs"])
    assert placed == list(range(len(lengths))), "the project's plan lost or repeated a document"
    t_ours, t_theirs = sum(o["time"] for o in ours), sum(t["time"] for t in theirs)
    assert abs(t_ours / plan.metrics()["step_time_total"] - 1) < 1e-9, "this script's time model != Plan.metrics()"
    lb = sum(bound(lengths, o["docs"], pool) for o in ours)
    counts = np.stack([t["micro_batches"] for t in theirs])
    return {
        "trace": trace, "pool": name, "pool_size": pool, "micro_batches": m, "max_tokens": topo.max_tokens,
        "tokens_per_step": topo.tokens_per_step, "cp_sizes": list(topo.cp_sizes), "steps": len(ours),
        "documents": len(lengths), "bound_total": lb,
        "project": {"time_total": t_ours, "excess": t_ours / lb - 1, "pad_hybrid": 0,
                    "pad_zigzag": sum(o["pad_zigzag"] for o in ours),
                    "pad_sequence": sum(o["pad_sequence"] for o in ours),
                    "micro_batches_per_rank_step": float(m), "plan_cpu_seconds": plan_cpu},
        "megatron": {"time_total": t_theirs, "excess": t_theirs / lb - 1, "pad": sum(t["pad"] for t in theirs),
                     "micro_batches_per_rank_step": float(counts.mean()),
                     "micro_batches_per_rank_step_max": int(counts.max()), "plan_cpu_seconds": meg_cpu},
    }  # fmt: skip


def dynamic_cp_scheduler() -> dict:
    """Whether the installed megatron-core has its newer dynamic-CP packing scheduler (development branches)."""
    from importlib.metadata import version
    from pathlib import Path

    import megatron.core

    root = Path(megatron.core.__file__).parent
    names = ("DefaultDynamicCPScheduler", "DpBalancedScheduler", "BasePackingScheduler")
    found = sorted({n for p in root.rglob("*.py") for n in names if f"class {n}" in p.read_text(errors="replace")})
    return {"searched": list(names), "found": found, "megatron_core": version("megatron-core")}


def summary_table(rows: list[dict]) -> dict:
    cells = []
    for r in rows:
        p, g = r["project"], r["megatron"]
        cells.append([
            r["trace"], r["pool"], str(r["steps"]),
            f"{p['excess']:.2%} / {g['excess']:.2%}",
            f"{p['pad_hybrid']} / {p['pad_zigzag']:,} / {p['pad_sequence']:,} / {g['pad']:,}",
            f"{p['micro_batches_per_rank_step']:.0f} / {g['micro_batches_per_rank_step']:.1f} "
            f"(max {g['micro_batches_per_rank_step_max']})",
            f"{median(p['plan_cpu_seconds']):.2f} / {median(g['plan_cpu_seconds']):.2f}",
        ])  # fmt: skip
    columns = [
        "trace", "pool", "steps", "excess over the bound: project / Megatron",
        "pad tokens: project hybrid / project zigzag / project sequence / Megatron",
        "micro-batches per rank per step: project / Megatron mean", "planning CPU s (epoch): project / Megatron",
    ]  # fmt: skip
    return table(columns, cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", nargs="+", default=["wlbllm", "prolong"])
    ap.add_argument("--pools", nargs="+", default=list(POOLS), choices=list(POOLS))
    ap.add_argument("--reps", type=int, default=3, help="paired planning-time reps (medians reported)")
    args = ap.parse_args()
    rows = []
    for trace in args.traces:
        for name in args.pools:
            rows.append(row(trace, name, *POOLS[name], args.reps))
            r = rows[-1]
            print(f"{trace} {name}: excess {r['project']['excess']:.4%} vs {r['megatron']['excess']:.4%}", flush=True)
    payload = {
        "question": __doc__.split("\n")[0],
        "cost_model": {"attn_coef": DEFAULT_COST.attn_coef, "linear_coef": DEFAULT_COST.linear_coef},
        "megatron_dynamic_cp_scheduler": dynamic_cp_scheduler(),
        "rows": rows,
        "tables": {"comparison": summary_table(rows)},
    }
    path = write_result("megatron_schedulers", payload, clock="process_cpu")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
