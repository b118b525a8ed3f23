"""What users would pick instead of this toolkit, each turned into a `balancer.Plan` for the one shared evaluator.

Every peer gets the same lengths, topology, cost model and seed, starts from the same seeded shuffle
(`np.random.default_rng(seed).permutation(n)`, the corpus order), and returns a Plan built with
`Plan.from_micro_batches` whose `natural_step` is
`balancer.planning.metrics.natural_steps(order, lengths, tokens_per_step)`
and whose `plan_seconds` is measured. Metrics are never computed here: `Plan.metrics()` does it for all of them.

Peers (see each function for what is the published algorithm and what is glue needed to make a valid plan):
- `trl_plan`: the real `trl.pack_dataset(strategy="bfd")` as SFTTrainer calls it (seq_length = max_tokens * cp,
  `datasets.map` in its default batches of 1,000 rows), then the Trainer's way of dealing packed rows: a seeded
  random permutation of the rows (RandomSampler), one row per micro-batch, row i of a step to DP rank i % dp
  (accelerate's batch sharding), dp * M rows per optimizer step. The global batch is fixed in rows, not tokens.
- `multipack_plan`: first-fit-decreasing bins by tokens (capacity max_tokens * cp), then LPT of the bins over the
  DP ranks by token count (multipack_sampler), on the same token-budget steps as the toolkit.
- `verl_plan`: Karmarkar-Karp (largest differencing) partition of each global batch over the DP ranks by verl's
  workload `24576 * L + L^2` (`calculate_workload`), then each rank's documents split into M micro-batches by a
  Karmarkar-Karp partition on tokens (`rearrange_micro_batches`).
- `wlb_plan`: benchmarks/wlb.py (WLB-LLM cost greedy with outlier delay).
- `balancer_plan`: this toolkit (`balancer.plan`).

`notes` on the returned plan (a dict attribute, `plan.peer_notes`) say what glue did: documents deferred to a later
step, micro-batches split to reach dp * M, rows dropped at the end of the epoch, and so on.
"""

from __future__ import annotations

import heapq
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wlb import wlb_plan  # noqa: E402,F401  (re-exported: one WLB implementation)

import balancer  # noqa: E402
from balancer.planning.metrics import natural_steps  # noqa: E402

VERL_WORKLOAD_A = 24576  # verl.utils.seqlen_balancing.calculate_workload: 24576 * L + L^2 (6 * 4096 for a 7B)


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """The corpus order every peer starts from."""
    return np.random.default_rng(seed).permutation(n)


def _finish(
    mbs: list[list[int]], lengths, topology, cost, seed, order, t0, notes, placed: np.ndarray | None = None
) -> balancer.Plan:
    """`mbs`: micro-batches in plan order (step-major, replica, m) -> Plan with notes attached."""
    p = balancer.Plan.from_flat_micro_batches(
        mbs,
        lengths,
        topology,
        cost,
        seed=seed,
        natural_step=natural_steps(order, lengths, topology.tokens_per_step),
        plan_seconds=time.perf_counter() - t0,
    )
    if placed is not None and np.any(placed[p.doc] != p.end):  # truncated documents keep their first tokens
        p = balancer.Plan(
            lengths,
            topology,
            cost,
            p.doc,
            p.start,
            placed[p.doc],
            p.mb_ptr,
            seed=seed,
            natural_step=p.natural_step,
            plan_seconds=p.plan_seconds,
        )
    p.peer_notes = {k: v for k, v in notes.items() if v}
    return p


def step_groups(order: np.ndarray, lengths: np.ndarray, topology) -> list[list[int]]:
    """The shuffled order cut every `tokens_per_step` tokens (the toolkit's step budget); a last group too small to
    fill dp * M micro-batches joins the one before."""
    step = natural_steps(order, lengths, topology.tokens_per_step)[order]
    bounds = np.flatnonzero(np.diff(step)) + 1
    groups = [g.tolist() for g in np.split(order, bounds)]
    while len(groups) > 1 and len(groups[-1]) < topology.bins_per_step:
        groups[-2].extend(groups.pop())
    return groups


def split_to(bins: list[list[int]], count: int, lengths: np.ndarray) -> int:
    """Split bins in place until there are `count` of them: the bin with the most tokens among those holding two or
    more documents is cut in two (its documents, longest first, dealt to the lighter half). Returns splits made."""
    splits = 0
    while len(bins) < count:
        cand = [i for i, b in enumerate(bins) if len(b) > 1]
        if not cand:
            raise ValueError(f"{sum(len(b) for b in bins)} documents cannot fill {count} non-empty micro-batches")
        i = max(cand, key=lambda j: int(lengths[bins[j]].sum()))
        a, b, ta, tb = [], [], 0, 0
        for d in sorted(bins[i], key=lambda d: -lengths[d]):
            if ta <= tb:
                a.append(d)
                ta += int(lengths[d])
            else:
                b.append(d)
                tb += int(lengths[d])
        bins[i] = a
        bins.append(b)
        splits += 1
    return splits


# ---- Karmarkar-Karp (verl.utils.seqlen_balancing, written from its description) -----------------------------------


def karmarkar_karp(weights, k: int, equal_size: bool = False) -> list[list[int]]:
    """k-way largest differencing: partitions of the item indices with sums as close as possible.

    Each item starts as a partial solution (k sets, the item in one of them); the two partial solutions with the
    largest spread (max set sum - min set sum) are merged by pairing the heaviest set of one with the lightest of the
    other, until one solution is left. `equal_size` (len(weights) % k == 0) starts from the sorted items taken k at
    a time, one per set, so every partition gets the same number of items.
    """
    w = [float(x) for x in weights]
    n = len(w)
    if k < 1:
        raise ValueError("k must be >= 1")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(weights) % k == 0, got {n} items for k={k}")
    idx = sorted(range(n), key=lambda i: (w[i], i))
    heap: list = []
    counter = 0

    def push(sums, items):
        nonlocal counter
        order = sorted(range(k), key=lambda j: -sums[j])
        sums = [sums[j] for j in order]
        items = [items[j] for j in order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), counter, sums, items))
        counter += 1

    if equal_size:
        for c in range(0, n, k):
            chunk = idx[c : c + k]
            push([w[i] for i in chunk], [[i] for i in chunk])
    else:
        for i in idx:
            push([w[i]] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)])
    while len(heap) > 1:
        _, _, sa, ia = heapq.heappop(heap)
        _, _, sb, ib = heapq.heappop(heap)
        sums, items = [], []
        for j in range(k):  # heaviest of one with the lightest of the other
            x, y = ia[j], ib[k - 1 - j]
            if len(x) < len(y):
                x, y = y, x
            x.extend(y)  # small into large: O(n log n) copying overall
            items.append(x)
            sums.append(sa[j] + sb[k - 1 - j])
        push(sums, items)
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(p) for p in heap[0][3]]


def verl_workload(lengths) -> np.ndarray:
    """verl's `calculate_workload`: FLOPs of a dense block up to a constant, 24576 * L + L^2."""
    L = np.asarray(lengths, dtype=np.float64)
    return VERL_WORKLOAD_A * L + L * L


# ---- shared step driver (glue common to the peers that plan step by step) ---------------------------------------


def _ffd(docs: list[int], lengths: np.ndarray, cap: int) -> list[list[int]]:
    """First-fit decreasing by tokens, opening a bin when a document fits no open one."""
    bins: list[list[int]] = []
    load = np.zeros(0, dtype=np.int64)
    for d in sorted(docs, key=lambda d: (-lengths[d], d)):
        fit = np.flatnonzero(load + lengths[d] <= cap)
        if len(fit):
            j = int(fit[0])
            bins[j].append(d)
            load[j] += lengths[d]
        else:
            bins.append([d])
            load = np.append(load, lengths[d])
    return bins


def _tail_steps(
    pool: list[int], lengths: np.ndarray, topology, bins: list[list[int]] | None = None
) -> list[list[list[int]]]:
    """Fallback for the epoch's end (too few leftover documents to fill a step of their own): FFD the leftovers and
    the last step's documents (or take the given `bins`), deal the bins over as few steps as they need (round robin,
    heaviest first), then give each step at least dp * M documents and split bins up to dp * M."""
    nb, cap = topology.bins_per_step, topology.micro_batch_tokens
    bins = _ffd(pool, lengths, cap) if bins is None else [list(b) for b in bins]
    pool = [d for b in bins for d in b]
    n_steps = -(-len(bins) // nb)
    if n_steps * nb > len(pool):
        raise ValueError(
            f"{len(pool)} leftover documents need {len(bins)} micro-batches: no whole number of "
            f"steps of {nb} non-empty micro-batches holds them"
        )
    bins.sort(key=lambda b: -int(lengths[b].sum()))
    steps = [bins[k::n_steps] for k in range(n_steps)]
    for st in steps:
        while sum(map(len, st)) < nb:  # borrow single documents from a step with spare ones
            donor = max(steps, key=lambda x: sum(map(len, x)))
            b = max((b for b in donor if len(b) > 1), key=len)
            d = min(b, key=lambda d: lengths[d])
            b.remove(d)
            st.append([d])
        split_to(st, nb, lengths)
    return steps


def _drive(groups: list[list[int]], step_fn, lengths: np.ndarray, topology, notes: dict) -> list[list[int]]:
    """Run `step_fn(docs) -> (nb bins in plan order, deferred docs)` over the step groups, carrying deferred
    documents forward; leftovers at the end make extra steps, or fold into the last one via `_tail_steps`."""
    nb = topology.bins_per_step
    steps: list[list[list[int]]] = []
    carry: list[int] = []
    for g in groups:
        bins, carry = step_fn(carry + list(g))
        steps.append(bins)
    while carry:
        if len(carry) >= nb:
            bins, rest = step_fn(carry)
            if len(rest) >= len(carry):
                raise RuntimeError("documents fit no step")
            steps.append(bins)
            carry = rest
        else:
            pool = list(carry)
            while True:  # fold in as many last steps as the leftovers need
                if not steps:
                    raise ValueError(f"{len(pool)} documents cannot fill {nb} micro-batches")
                pool = [d for b in steps.pop() for d in b] + pool
                try:
                    tail = _tail_steps(pool, lengths, topology)
                    break
                except ValueError:
                    continue
            notes["tail_fallback_docs"] = len(pool)
            steps.extend(
                _lpt_ranks(
                    st, np.array([lengths[b].sum() for b in st], dtype=np.float64), topology.dp, topology.micro_batches
                )
                for st in tail
            )
            carry = []
    notes["extra_steps"] = len(steps) - len(groups)
    return [b for st in steps for b in st]


def _lpt_ranks(bins: list[list[int]], weight: np.ndarray, dp: int, m: int) -> list[list[int]]:
    """LPT of dp * m bins over dp ranks by `weight`, m bins per rank -> bins in plan order (rank-major)."""
    order = sorted(range(len(bins)), key=lambda i: -weight[i])
    load = np.zeros(dp)
    slots: list[list[int]] = [[] for _ in range(dp)]
    for i in order:
        open_ = [r for r in range(dp) if len(slots[r]) < m]
        r = min(open_, key=lambda r: load[r])
        slots[r].append(i)
        load[r] += weight[i]
    return [bins[i] for r in range(dp) for i in slots[r]]


# ---- multipack ---------------------------------------------------------------------------------------------------


def multipack_plan(lengths, topology, cost, seed: int = 0) -> balancer.Plan:
    """multipack: FFD bins by tokens (cap max_tokens * cp) per token-budget step, then LPT of the bins over the DP
    ranks by tokens, M bins per rank.

    Glue: a step whose FFD opens fewer than dp * M bins has its fullest multi-document bins split in two; bins
    beyond dp * M (the step's documents do not fit its micro-batches) are deferred to the next step."""
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    cap, nb = topology.micro_batch_tokens, topology.bins_per_step
    if lengths.max() > cap:
        raise ValueError(f"multipack cannot place a document of {lengths.max()} tokens (cap {cap})")
    order = shuffled_order(len(lengths), seed)
    notes = {"bins_split": 0, "docs_deferred": 0}

    def step_fn(docs):
        bins = _ffd(docs, lengths, cap)
        carry = [d for b in bins[nb:] for d in b]
        bins = bins[:nb]
        notes["docs_deferred"] += len(carry)
        notes["bins_split"] += split_to(bins, nb, lengths)
        tok = np.array([lengths[b].sum() for b in bins], dtype=np.float64)
        return _lpt_ranks(bins, tok, topology.dp, topology.micro_batches), carry

    mbs = _drive(step_groups(order, lengths, topology), step_fn, lengths, topology, notes)
    return _finish(mbs, lengths, topology, cost, seed, order, t0, notes)


# ---- verl --------------------------------------------------------------------------------------------------------


def verl_plan(lengths, topology, cost, seed: int = 0) -> balancer.Plan:
    """verl: per token-budget global batch, KK partition over DP ranks by `24576*L + L^2` (equal_size=False, the
    dynamic-batch path), then each rank's documents KK-partitioned by tokens into M micro-batches.

    Glue (verl would instead raise the micro-batch count on every rank, i.e. change M, or run out of memory):
    micro-batches over the cap shed their smallest documents to micro-batches of the same rank with room; documents
    fitting nowhere on their rank are deferred to the next step; a rank (micro-batch) left with fewer than M
    documents (none) takes the smallest document of the rank (micro-batch) holding the most."""
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    cap, dp, m = topology.micro_batch_tokens, topology.dp, topology.micro_batches
    if lengths.max() > cap:
        raise ValueError(f"verl cannot place a document of {lengths.max()} tokens (cap {cap})")
    order = shuffled_order(len(lengths), seed)
    work = verl_workload(lengths)
    notes = {"docs_deferred": 0, "docs_moved_for_cap": 0, "docs_moved_to_fill": 0}

    def step_fn(docs):
        carry: list[int] = []
        ranks = [[docs[i] for i in part] for part in karmarkar_karp(work[docs], dp)]
        for r in range(dp):  # every rank needs M documents for M micro-batches
            while len(ranks[r]) < m:
                donor = max(range(dp), key=lambda q: len(ranks[q]))
                if len(ranks[donor]) <= m:
                    raise ValueError(f"verl: {len(docs)} documents cannot fill {dp * m} micro-batches")
                d = min(ranks[donor], key=lambda d: lengths[d])
                ranks[donor].remove(d)
                ranks[r].append(d)
                notes["docs_moved_to_fill"] += 1
        out: list[list[int]] = []
        for r in range(dp):
            parts = [[ranks[r][i] for i in p] for p in karmarkar_karp(lengths[ranks[r]], m)]
            tok = [int(lengths[p].sum()) for p in parts]
            for j in range(m):  # cap repair inside the rank
                while tok[j] > cap:
                    d = min(parts[j], key=lambda d: lengths[d])
                    parts[j].remove(d)
                    tok[j] -= int(lengths[d])
                    room = [q for q in range(m) if q != j and tok[q] + lengths[d] <= cap]
                    if room:
                        q = min(room, key=lambda q: tok[q])
                        parts[q].append(d)
                        tok[q] += int(lengths[d])
                        notes["docs_moved_for_cap"] += 1
                    else:
                        carry.append(d)
                        notes["docs_deferred"] += 1
            for j in range(m):
                if not parts[j]:  # KK or the cap repair left it empty
                    donor = max(range(m), key=lambda q: len(parts[q]))
                    if len(parts[donor]) < 2:
                        raise ValueError("verl: a rank cannot fill its micro-batches")
                    d = min(parts[donor], key=lambda d: lengths[d])
                    parts[donor].remove(d)
                    parts[j].append(d)
                    notes["docs_moved_to_fill"] += 1
            out.extend(parts)
        return out, carry

    mbs = _drive(step_groups(order, lengths, topology), step_fn, lengths, topology, notes)
    return _finish(mbs, lengths, topology, cost, seed, order, t0, notes)


# ---- TRL ---------------------------------------------------------------------------------------------------------


def trl_pack(lengths, seq_length: int, order: np.ndarray | None = None, map_kwargs: dict | None = None):
    """Run the real `trl.pack_dataset(strategy="bfd")` on a dataset whose rows have the documents' lengths.

    Rows are in `order` (the corpus order); every token of document i is the token id i (int32), so each packed
    segment names its document. Returns (rows: list of int64 arrays of document ids, seconds, placed tokens per
    document). Raises MemoryError if the corpus does not fit in memory.
    """
    import pyarrow as pa
    from datasets import Dataset, disable_progress_bars
    from trl.data_utils import pack_dataset

    disable_progress_bars()
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(len(lengths)) if order is None else np.asarray(order)
    if lengths.sum() >= 2**31:
        raise MemoryError(f"{lengths.sum()} tokens: more than one Arrow list column holds (2^31)")
    t0 = time.perf_counter()
    lo = lengths[order]
    values = np.repeat(order.astype(np.int32), lo)
    offsets = np.concatenate([[0], np.cumsum(lo)]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    del values
    ds = Dataset(pa.table({"input_ids": column}), fingerprint=f"peers-{len(lengths)}-{int(lengths.sum())}")
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    packed = pack_dataset(ds, seq_length, strategy="bfd", map_kwargs=map_kwargs)
    table = packed.with_format("arrow")[:]
    pack_s = time.perf_counter() - t0
    ids = table.column("input_ids").combine_chunks()
    seq = table.column("seq_lengths").combine_chunks()
    vals = ids.flatten().to_numpy()
    seg_len = seq.flatten().to_numpy().astype(np.int64)
    seg_per_row = np.diff(seq.offsets.to_numpy())
    row_len = np.diff(ids.offsets.to_numpy()).astype(np.int64)
    row_of_seg = np.repeat(np.arange(len(seg_per_row)), seg_per_row)
    if len(vals) != int(seg_len.sum()) or not np.array_equal(
        np.bincount(row_of_seg, weights=seg_len, minlength=len(row_len)).astype(np.int64), row_len
    ):
        raise RuntimeError("TRL packed rows do not match their seq_lengths")
    seg_start = np.cumsum(seg_len) - seg_len
    seg_doc = vals[seg_start].astype(np.int64)
    if not np.array_equal(vals, np.repeat(seg_doc, seg_len).astype(vals.dtype)):
        raise RuntimeError("a TRL packed segment mixes two documents")
    placed = np.bincount(seg_doc, weights=seg_len, minlength=len(lengths)).astype(np.int64)
    rows = np.split(seg_doc, np.cumsum(seg_per_row)[:-1])
    return rows, pack_s + build_s, placed


def trl_plan(lengths, topology, cost, seed: int = 0, packed=None, tail: str = "split") -> balancer.Plan:
    """TRL BFD packing + the Trainer's row dealing (see module docstring).

    `packed` reuses a `trl_pack` result for the same lengths, seed and seq_length (its measured seconds count in
    plan_seconds). `tail`: the last optimizer step has fewer than dp * M rows; "split" cuts its rows (most tokens
    first) into dp * M micro-batches (what a trainer would rather do than pad with repeated rows; the kindest choice
    for TRL); when they hold fewer than dp * M documents, they and the step before are dealt over two steps (whole
    rows, round robin), with rows split as needed; "drop" drops them (drop_last; counted in dropped_tokens)."""
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    order = shuffled_order(len(lengths), seed)
    seq_length = topology.micro_batch_tokens
    if packed is None:
        packed = trl_pack(lengths, seq_length, order)
    rows, pack_s, placed = packed
    notes = {"truncated_tokens": int((lengths - placed).sum()), "rows": len(rows), "tail": ""}
    import torch

    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).numpy()
    rows = [rows[i].tolist() for i in perm]  # RandomSampler over the packed rows
    nb, dp, m = topology.bins_per_step, topology.dp, topology.micro_batches
    full = len(rows) // nb
    mbs: list[list[int]] = []
    for k in range(full):
        step = rows[k * nb : (k + 1) * nb]  # row i of the step: rank i % dp, micro-batch i // dp
        mbs.extend(step[j * dp + r] for r in range(dp) for j in range(m))
    rest = rows[full * nb :]
    if rest:
        ndocs = sum(map(len, rest))
        tok = int(sum(lengths[r].sum() for r in rest))
        if tail == "split" and ndocs >= nb:
            n_rest = len(rest)
            splits = split_to(rest, nb, lengths)
            mbs.extend(rest[j * dp + r] for r in range(dp) for j in range(m))
            notes["tail"] = f"last step: {n_rest} rows split into {nb} micro-batches ({splits} splits)"
        elif tail == "split" and full:
            prev = rows[(full - 1) * nb : full * nb]
            del mbs[-nb:]
            steps = _tail_steps([], lengths, topology, bins=prev + rest)
            for st in steps:
                mbs.extend(st[j * dp + r] for r in range(dp) for j in range(m))
            notes["tail"] = (
                f"last step: {len(rest)} rows ({ndocs} docs) and the {nb} rows before dealt over "
                f"{len(steps)} steps, rows split to fill them"
            )
        else:
            notes["tail"] = f"last step: {len(rest)} rows ({ndocs} docs, {tok} tokens) dropped (drop_last)"
    plan = _finish(mbs, lengths, topology, cost, seed, order, t0, notes, placed=placed)
    plan.plan_seconds += pack_s
    return plan


# ---- this toolkit ------------------------------------------------------------------------------------------------


def balancer_plan(lengths, topology, cost, seed: int = 0) -> balancer.Plan:
    p = balancer.plan(lengths, topology, cost, seed=seed)
    p.peer_notes = {}
    return p


def wlb_peer(lengths, topology, cost, seed: int = 0) -> balancer.Plan:
    p = wlb_plan(lengths, topology, cost, seed=seed)
    p.peer_notes = {}
    return p


PEERS = {
    "trl": trl_plan,
    "multipack": multipack_plan,
    "verl": verl_plan,
    "wlb": wlb_peer,
    "balancer": balancer_plan,
}
