"""Token-count packing, the way most trainers balance today (multipack / TRL BFD style), as a reference plan.

Same shuffle and the same step cut as `balancer.plan` would see, then each step's documents are dealt, longest
first, to the micro-batch with the fewest tokens (LPT by tokens). It ignores attention cost: the point of comparison
for `balancer demo` and `balancer plan`.
"""

from __future__ import annotations

import time

import numpy as np

from balancer.planning.cost import CostModel
from balancer.planning.metrics import natural_steps
from balancer.planning.plans import Plan
from balancer.planning.topology import Topology
from balancer.planning.units import validate_lengths


def token_count_plan(lengths, topology: Topology, cost: CostModel, seed: int = 0) -> Plan:
    """Plan an epoch balancing token counts only (documents must fit `max_tokens * cp`)."""
    t0 = time.perf_counter()
    lengths = validate_lengths(lengths)
    cap, nb = topology.micro_batch_tokens, topology.bins_per_step
    if lengths.max() > cap:
        i = int(np.argmax(lengths))
        raise ValueError(f"document {i} has {lengths[i]} tokens > max_tokens*cp = {cap}")
    order = np.random.default_rng(seed).permutation(len(lengths))
    step_of = np.empty(len(lengths), dtype=np.int64)
    step_of[order] = (np.cumsum(lengths[order]) - lengths[order]) // topology.tokens_per_step
    n_steps = int(step_of.max()) + 1
    groups = [list(order[step_of[order] == s]) for s in range(n_steps)]
    while len(groups) > 1 and len(groups[-1]) < nb:  # a tail too small to fill every micro-batch joins the last
        groups[-2].extend(groups.pop())
    mbs: list[list[int]] = []
    carry: list[int] = []
    s = 0
    while s < len(groups) or carry:
        docs = carry + (groups[s] if s < len(groups) else [])
        carry = []
        bins: list[list[int]] = [[] for _ in range(nb)]
        tok = np.zeros(nb, dtype=np.int64)
        for d in sorted(docs, key=lambda d: -lengths[d]):
            fits = np.where(tok + lengths[d] <= cap, tok, np.iinfo(np.int64).max)
            j = int(np.argmin(fits))
            if fits[j] == np.iinfo(np.int64).max:
                carry.append(d)
                continue
            bins[j].append(d)
            tok[j] += lengths[d]
        for j in range(nb):  # no empty micro-batch: take from the fullest
            if not bins[j]:
                donor = max(range(nb), key=lambda k: len(bins[k]))
                bins[j].append(bins[donor].pop())
        # micro-batch j goes to replica j % dp, so the longest documents (dealt first) land on different replicas
        mbs.extend(bins[r :: topology.dp][k] for r in range(topology.dp) for k in range(topology.micro_batches))
        s += 1
    steps = [
        [
            mbs[(k * topology.dp + r) * topology.micro_batches : (k * topology.dp + r + 1) * topology.micro_batches]
            for r in range(topology.dp)
        ]
        for k in range(len(mbs) // nb)
    ]
    return Plan.from_micro_batches(
        steps,
        lengths,
        topology,
        cost,
        seed=seed,
        natural_step=natural_steps(order, lengths, topology.tokens_per_step),
        plan_seconds=time.perf_counter() - t0,
    )
