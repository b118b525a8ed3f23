"""Peers run from the code their package installs (the 2026 built-ins), each given the problem its own API takes.

- `hf_rebalance_plan`: transformers' `BatchRebalanceSampler` (`Trainer(train_sampling_strategy="batch_rebalance")`,
  transformers.trainer_pt_utils): a global batch fixed in documents (`effective_batch_size`), its own seeded
  shuffle, `dp_size` x `grad_accum` micro-batches; one sampler per DP rank, as every rank runs one. It has no token
  cap (it balances padded cost `bs * max_len + 0.001 * bs * max_len^2`).
- `verl_pkg_plan`: verl's own functions (verl.utils.seqlen_balancing): the trainer's DP balance of a global batch
  (`get_seqlen_balanced_partitions(calculate_workload(lengths), dp, equal_size=True)`, as
  `RayPPOTrainer._balance_batch`), then each rank's `rearrange_micro_batches(max_token_len=max_tokens,
  min_num_micro_batch=M)` with the micro-batch count made equal over the ranks (what its `dp_group` all-reduce
  does).
- `balancer_slices_plan`: this project on the same fixed global batches (`balancer.balance_batch` per slice).

The count-based peers see the same slices: the shuffle is BatchRebalanceSampler's (`torch.randperm(n)` seeded with
`seed`), cut every `docs_per_step` documents. Where a peer's micro-batch holds more than `max_tokens * cp` tokens
(it takes no token cap, or needs more than M micro-batches to keep one), the plan is scored under a topology whose
`max_tokens` is raised to fit it, and `notes["over_cap_micro_batches"]` counts them: the compute-only metrics do
not depend on the cap, but such a plan does not run on the user's memory.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import balancer


def hf_order(n: int, seed: int) -> np.ndarray:
    """BatchRebalanceSampler's epoch-0 shuffle: torch.randperm(n) from a generator seeded with `seed`."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).numpy()


def docs_per_step(n: int, topology, steps: int) -> int:
    """Documents per global batch for `steps` steps: a multiple of dp whose last batch is empty or holds at least
    dp * M documents (smaller tails would be padded with repeated documents by the sampler)."""
    k, dp = topology.bins_per_step, topology.dp
    base = max(k, -(-n // max(1, steps)))
    for delta in range(0, base):
        for b in (base + delta, base - delta):
            if b >= k and b % dp == 0 and (n % b == 0 or n % b >= k):
                return b
    raise ValueError(f"no batch size fits {n} documents in steps of {k} micro-batches")


def _scored(steps_mbs, lengths, topology, cost, seed, natural, t0, notes) -> balancer.Plan:
    """Plan of `steps_mbs[s][r][m]`, under a topology whose cap fits its largest micro-batch."""
    cap = topology.micro_batch_tokens
    sizes = [int(lengths[mb].sum()) for st in steps_mbs for rep in st for mb in rep]
    over = sum(s > cap for s in sizes)
    topo = topology
    if over:
        need = -(-max(sizes) // topology.cp)
        topo = dataclasses.replace(topology, max_tokens=need, tokens_per_step=topology.tokens_per_step)
        notes["over_cap_micro_batches"] = over
        notes["max_tokens_needed"] = need
    plan = balancer.Plan.from_micro_batches(
        steps_mbs, lengths, topo, cost, seed=seed, natural_step=natural, plan_seconds=time.perf_counter() - t0
    )
    plan.peer_notes = {k: v for k, v in notes.items() if v}
    return plan


def _slices(n: int, topology, seed: int, steps: int) -> tuple[np.ndarray, int, np.ndarray]:
    order = hf_order(n, seed)
    b = docs_per_step(n, topology, steps)
    natural = np.empty(n, dtype=np.int64)
    natural[order] = np.arange(n) // b
    return order, b, natural


def hf_rebalance_plan(lengths, topology, cost, seed: int = 0, steps: int = 1) -> balancer.Plan:
    """transformers' BatchRebalanceSampler, one per DP rank, over global batches of `docs_per_step` documents."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    dp, m = topology.dp, topology.micro_batches
    _, b, natural = _slices(len(lengths), topology, seed, steps)
    per_rank = []
    for r in range(dp):
        sampler = BatchRebalanceSampler(
            lengths=lengths.tolist(), effective_batch_size=b, dp_size=dp, grad_accum=m, seed=seed, rank=r,
            drop_last=False,
        )  # fmt: skip
        per_rank.append(list(sampler))
    n_steps = len(per_rank[0]) // m
    mbs = [[per_rank[r][s * m : (s + 1) * m] for r in range(dp)] for s in range(n_steps)]
    return _scored(mbs, lengths, topology, cost, seed, natural, t0, {"docs_per_step": b})


def _verl_rank_micro_batches(lens: np.ndarray, max_token_len: int, m: int, count: int | None):
    """verl's rearrange_micro_batches on one rank's documents. The batch carries each document's length as a
    one-column `attention_mask` (the function reads only its row sums and, for a check done here instead, its width):
    the same partition as from full masks, without materialising B x max_len of them."""
    import torch
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    if int(lens.max()) > max_token_len:
        raise ValueError(f"a document of {int(lens.max())} tokens exceeds max_token_len={max_token_len}")
    mask = torch.from_numpy(np.ascontiguousarray(lens, dtype=np.int64))[:, None]
    batch = TensorDict({"input_ids": torch.zeros(len(lens), 1, dtype=torch.int32), "attention_mask": mask},
                       batch_size=[len(lens)])  # fmt: skip
    _, idx = rearrange_micro_batches(batch, max_token_len=max_token_len, min_num_micro_batch=count or m)
    return idx


def verl_pkg_plan(lengths, topology, cost, seed: int = 0, steps: int = 1) -> balancer.Plan:
    """verl's DP balance and micro-batch rearrangement, from the verl package, over the same global batches."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    order, b, natural = _slices(len(lengths), topology, seed, steps)
    notes = {"docs_per_step": b, "steps_with_more_micro_batches": 0}
    out = []
    for s0 in range(0, len(order), b):
        docs = order[s0 : s0 + b]
        work = calculate_workload(torch.from_numpy(lengths[docs])).tolist()
        parts = get_seqlen_balanced_partitions(work, dp, equal_size=len(docs) % dp == 0)
        ranks = [docs[p] for p in parts]
        cap_r = max(cap, int(max(lengths[r].max() for r in ranks)))
        try:
            idx = [_verl_rank_micro_batches(lengths[r], cap_r, m, None) for r in ranks]
            count = max(len(i) for i in idx)
        except ValueError:  # a rank cannot keep the cap with as many micro-batches as it has documents
            count = m + 1
        if count > m:  # verl would run `count` micro-batches here; the user's M holds them only above the cap
            notes["steps_with_more_micro_batches"] += 1
            idx = [_verl_rank_micro_batches(lengths[r], int(lengths[r].sum()), m, m) for r in ranks]
        elif any(len(i) < count for i in idx):
            idx = [_verl_rank_micro_batches(lengths[r], cap_r, m, count) for r in ranks]
        out.append([[r[np.asarray(p, dtype=np.int64)].tolist() for p in i] for r, i in zip(ranks, idx)])
    return _scored(out, lengths, topology, cost, seed, natural, t0, notes)


def _balance_slice(lengths: np.ndarray, topology, cost, seed: int) -> balancer.Plan:
    """balance_batch at the user's cap; a slice whose tokens do not fit dp * M micro-batches there (count-based
    slices ignore the token budget) is planned with max_tokens raised by 1/8 until it fits."""
    topo = topology
    while True:
        try:
            return balancer.balance_batch(lengths, topo, cost, seed=seed)
        except ValueError as e:
            if "does not fit" not in str(e) and "more than one step holds" not in str(e):
                raise
            topo = dataclasses.replace(topo, max_tokens=topo.max_tokens + max(1, topo.max_tokens // 8))


def balancer_slices_plan(lengths, topology, cost, seed: int = 0, steps: int = 1) -> balancer.Plan:
    """`balancer.balance_batch` on each of the count-based peers' global batches (the same slices)."""
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    order, b, natural = _slices(len(lengths), topology, seed, steps)
    out = []
    for s0 in range(0, len(order), b):
        docs = order[s0 : s0 + b]
        p = _balance_slice(lengths[docs], topology, cost, seed)
        out.append([[docs[mb.docs].tolist() for mb in rep.micro_batches] for rep in p.steps[0].replicas])
    return _scored(out, lengths, topology, cost, seed, natural, t0, {"docs_per_step": b})


PKG_PEERS = {
    "hf_rebalance": hf_rebalance_plan,
    "verl_pkg": verl_pkg_plan,
    "balancer_slices": balancer_slices_plan,
}


# ---- the 2026 suite's scoring: excess over the bounds --------------------------------------------------------------

PROJECT = ("balancer", "balancer_slices")
SLICE_PEERS = ("hf_rebalance", "verl_pkg")
GOAL_RATIO = 0.5  # the project's excess over the epoch bound <= 50% of the best peer's


def excess(rec: dict) -> tuple[float | None, float | None]:
    """(excess over the epoch bound, excess over the plan's own per-step bounds): 1/epoch_efficiency - 1 and
    imbalance - 1; None where the peer made no plan."""
    if rec.get("status") != "ok":
        return None, None
    return 1.0 / rec["epoch_efficiency"] - 1.0, rec["imbalance"] - 1.0


def score_row(row: dict) -> None:
    """Per-peer excesses, the best peer, and the project's ratio to it (overall and on the same fixed slices)."""
    for rec in row["peers"].values():
        rec["excess_epoch"], rec["excess_step"] = excess(rec)

    def best(names):
        have = [(row["peers"][p]["excess_epoch"], p) for p in names if row["peers"][p].get("excess_epoch") is not None]
        return min(have) if have else (None, None)

    peers_ = [p for p in row["peers"] if p not in PROJECT]
    row["best_peer_excess"], row["best_peer"] = best(peers_)
    mine = row["peers"]["balancer"].get("excess_epoch")
    row["ratio"] = _ratio(mine, row["best_peer_excess"])
    row["slices_best_peer_excess"], row["slices_best_peer"] = best([p for p in SLICE_PEERS if p in row["peers"]])
    row["slices_ratio"] = _ratio(row["peers"].get("balancer_slices", {}).get("excess_epoch"),
                                 row["slices_best_peer_excess"])  # fmt: skip
    row["slices_floor_excess"] = slices_floor(row["peers"].get("balancer_slices", {}))
    row["slices_floor_ratio"] = _ratio(row["slices_floor_excess"], row["slices_best_peer_excess"])
    # the part of the epoch excess no plan with the project's steps can remove (whole documents at cp = 1)
    b = row["peers"]["balancer"]
    row["step_bound_excess"] = (
        b["step_time_total"] / b["imbalance"] / b["lower_bound_epoch"] - 1.0 if b.get("status") == "ok" else None
    )
    row["goal_met"] = row["ratio"] is not None and row["ratio"] <= GOAL_RATIO
    row["zero_drop"] = all(r.get("dropped_tokens", 1) == 0 for r in row["peers"].values() if r.get("status") == "ok")


def slices_floor(rec: dict) -> float | None:
    """The excess over the epoch bound that no plan of the same fixed slices goes under: every step at its own
    lower bound (`max(W / dp, the heaviest document)` at cp = pp = 1), from a slice plan's record (its summed step
    time over its `imbalance` is the sum of those bounds); None where it made no plan or its record predates the
    step times."""
    if rec.get("status") != "ok" or "step_time_total" not in rec:
        return None
    return rec["step_time_total"] / rec["imbalance"] / rec["lower_bound_epoch"] - 1.0


def _ratio(mine, theirs):
    if mine is None or theirs is None:
        return None
    if theirs <= 0:
        return 0.0 if mine <= 0 else float("inf")
    return mine / theirs


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def excess_markdown(rows: list[dict]) -> str:
    """One line per row: every peer's excess over the epoch bound, the project's, and the ratio to the best."""
    names = [p for p in rows[0]["peers"] if p not in PROJECT] if rows else []
    head = (
        "| distribution | topology | " + " | ".join(names) + " | balancer | per-step bound | balancer / best peer | "
        "balancer_slices | slices / best slice peer |\n|---|---|" + "---:|" * (len(names) + 5) + "\n"
    )
    lines = []
    for row in rows:
        cells = []
        for p in names:
            rec = row["peers"][p]
            cell = _pct(rec.get("excess_epoch")) if rec.get("status") == "ok" else rec["status"][:24]
            if rec.get("notes", {}).get("over_cap_micro_batches"):
                cell += " (over cap)"
            cells.append(f"**{cell}**" if p == row.get("best_peer") else cell)
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.0%}"
        sratio = "-" if row["slices_ratio"] is None else f"{row['slices_ratio']:.0%}"
        lines.append(
            f"| {row['distribution']} | {row['topology']} | " + " | ".join(cells)
            + f" | {_pct(row['peers']['balancer'].get('excess_epoch'))} | {_pct(row['step_bound_excess'])} | "
            f"{ratio} | {_pct(row['peers'].get('balancer_slices', {}).get('excess_epoch'))} | {sratio} |"
        )  # fmt: skip
    return head + "\n".join(lines) + "\n"


# ---- compare.py --seeds: the equal-slices comparison over several seeds ---------------------------------------------


def seed_summary(runs: list[dict]) -> list[dict]:
    """Per (distribution, topology): balancer_slices' and the best slice peer's excess and their ratio for every
    seed, the mean and worst ratio, and whether the worst is within GOAL_RATIO."""
    keys = list(dict.fromkeys((r["distribution"], r["topology"]) for r in runs))
    rows = []
    for dist, topo in keys:
        mine = [r for r in runs if (r["distribution"], r["topology"]) == (dist, topo)]
        ratios = [r["slices_ratio"] for r in mine]
        known = [x for x in ratios if x is not None]
        rows.append(
            dict(
                distribution=dist,
                topology=topo,
                seeds=[r["seed"] for r in mine],
                slices_excess=[r["peers"]["balancer_slices"].get("excess_epoch") for r in mine],
                best_slice_peer=[r["slices_best_peer"] for r in mine],
                best_slice_peer_excess=[r["slices_best_peer_excess"] for r in mine],
                ratios=ratios,
                mean=float(np.mean(known)) if known else None,
                worst=max(known) if len(known) == len(ratios) and known else None,
                **floor_summary(mine),
            )
        )
        rows[-1]["goal_met"] = rows[-1]["worst"] is not None and rows[-1]["worst"] <= GOAL_RATIO
    return rows


def floor_summary(runs: list[dict]) -> dict:
    """Per seed of one row: the slices' floor (`slices_floor`) and its ratio to the best slice peer's excess; the
    worst such ratio, and whether the goal is reachable at all (that worst within GOAL_RATIO)."""
    floors = [slices_floor(r["peers"].get("balancer_slices", {})) for r in runs]
    ratios = [_ratio(f, r["slices_best_peer_excess"]) for f, r in zip(floors, runs)]
    known = [x for x in ratios if x is not None]
    worst = max(known) if known and len(known) == len(ratios) else None
    return dict(floor_excess=floors, floor_ratios=ratios, floor_worst=worst,
                goal_reachable=worst is not None and worst <= GOAL_RATIO)  # fmt: skip


def seeds_markdown(rows: list[dict]) -> str:
    """One line per row: balancer_slices' and the best slice peer's mean excess, the ratio's mean and worst."""
    lines = [
        "| distribution | topology | balancer_slices excess (mean) | best slice peer excess (mean) | "
        "ratio mean | ratio worst |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        mean_mine = _mean_or_none(r["slices_excess"])
        mean_peer = _mean_or_none(r["best_slice_peer_excess"])
        ratio = ["-" if x is None else f"{x:.0%}" for x in (r["mean"], r["worst"])]
        lines.append(
            f"| {r['distribution']} | {r['topology']} | {_pct(mean_mine)} | {_pct(mean_peer)} | {ratio[0]} | "
            f"{ratio[1]} |"
        )
    return "\n".join(lines) + "\n"


def _mean_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) or not values else float(np.mean(values))
