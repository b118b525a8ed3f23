"""WLB-LLM style cost-greedy packing with outlier delay, implemented from the paper's description.

Wang et al., "WLB-LLM: Workload-Balance 4D Parallelism for Large Language Model Training" (OSDI 2025), section 4:
- variable-length packing: the documents of a global batch, heaviest first, each go to the micro-batch with the
  smallest estimated workload (attention + linear cost) that still has room under the sequence-length cap;
- outlier delay: documents longer than a threshold wait in a queue; once the queue holds as many documents as
  there are micro-batches, they are released together into the next global batch (one per micro-batch).
The per-document greedy is the published algorithm; it is written the straightforward way (numpy argmin over the
micro-batches per document), which is also how we time it.
"""

from __future__ import annotations

import time

import numpy as np

import balancer
from balancer.planning.metrics import natural_steps


def wlb_plan(
    lengths, topology: balancer.Topology, cost: balancer.CostModel, seed: int = 0, outlier_tokens: int | None = None
) -> balancer.Plan:
    """Plan an epoch WLB-style. `outlier_tokens` defaults to a quarter of the micro-batch token cap."""
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    cap, nb, tps = topology.micro_batch_tokens, topology.bins_per_step, topology.tokens_per_step
    if lengths.max() > cap:
        raise ValueError(f"WLB packing cannot place a document of {lengths.max()} tokens (cap {cap})")
    threshold = cap // 4 if outlier_tokens is None else outlier_tokens
    order = np.random.default_rng(seed).permutation(len(lengths))
    costs = cost.cost(lengths)
    queue: list[int] = []
    batches: list[list[int]] = []
    i, n = 0, len(order)
    while i < n:
        batch: list[int] = []
        tokens = 0
        if len(queue) >= nb:
            batch, queue = queue[:nb], queue[nb:]
            tokens = int(lengths[batch].sum())
        while tokens < tps and i < n:
            d = int(order[i])
            i += 1
            if lengths[d] > threshold:
                queue.append(d)
                continue
            batch.append(d)
            tokens += int(lengths[d])
        batches.append(batch)
    while queue:  # the epoch's tail: release what is still waiting
        batches.append(queue[:nb])
        queue = queue[nb:]
    # a batch too small to fill every micro-batch joins the one before
    merged: list[list[int]] = []
    for b in batches:
        if merged and len(b) < nb:
            merged[-1].extend(b)
        else:
            merged.append(list(b))
    if len(merged) > 1 and len(merged[0]) < nb:
        merged[1].extend(merged.pop(0))

    mbs: list[list[int]] = []
    carry: list[int] = []
    s = 0
    while s < len(merged) or carry:
        docs = carry + (merged[s] if s < len(merged) else [])
        carry = []
        bins: list[list[int]] = [[] for _ in range(nb)]
        load = np.zeros(nb)
        tok = np.zeros(nb, dtype=np.int64)
        for d in sorted(docs, key=lambda d: -costs[d]):
            masked = np.where(tok + lengths[d] <= cap, load, np.inf)
            j = int(np.argmin(masked))
            if not np.isfinite(masked[j]):
                carry.append(d)
                continue
            bins[j].append(d)
            load[j] += costs[d]
            tok[j] += lengths[d]
        mbs.extend(bins)
        s += 1
    # no empty micro-batch: an empty one takes a document from the fullest micro-batch of its step, or (a tail
    # step built from deferred documents only) of any earlier step
    for j in range(len(mbs)):
        if not mbs[j]:
            first = (j // nb) * nb
            pool = (
                range(first, first + nb) if max(len(mbs[k]) for k in range(first, first + nb)) > 1 else range(len(mbs))
            )
            donor = max(pool, key=lambda k: len(mbs[k]))
            if len(mbs[donor]) < 2:
                raise ValueError("WLB packing: too few documents to fill every micro-batch")
            mbs[j].append(mbs[donor].pop())
    m, dp = topology.micro_batches, topology.dp
    steps = [[mbs[(k * dp + r) * m : (k * dp + r + 1) * m] for r in range(dp)] for k in range(len(mbs) // nb)]
    return balancer.Plan.from_micro_batches(
        steps,
        lengths,
        topology,
        cost,
        seed=seed,
        natural_step=natural_steps(order, lengths, tps),
        plan_seconds=time.perf_counter() - t0,
    )
