"""Token-count packing, the way most trainers balance today (multipack / TRL BFD style), as a reference plan.

Same shuffle and the same step cut as `balancer.plan` would see, then each step's documents are dealt, longest
first, to the micro-batch with the fewest tokens (LPT by tokens). It ignores attention cost: the point of comparison
for `balancer demo` and `balancer plan`.

Cost: O(n log n) for the shuffle and the sorts plus O(n log(dp * micro_batches)) for the dealing (a heap of
micro-batch loads); steps are cut with one pass over the shuffled order, so step numbers no document starts in
(a document longer than `tokens_per_step` spans them) cost nothing.
"""

from __future__ import annotations

import heapq
import time

import numpy as np
from numpy.typing import ArrayLike

from balancer.planning.cost.model import CostModel
from balancer.planning.metrics import natural_steps
from balancer.planning.plans.plan import Plan
from balancer.planning.topology import Topology
from balancer.planning.units import validate_lengths


def token_count_plan(lengths: ArrayLike, topology: Topology, cost: CostModel, seed: int = 0) -> Plan:
    """Plan an epoch balancing token counts only (documents must fit `max_tokens * cp`)."""
    t0 = time.perf_counter()
    lengths = validate_lengths(lengths)
    cap, nb = topology.micro_batch_tokens, topology.bins_per_step
    if lengths.max() > cap:
        i = int(np.argmax(lengths))
        raise ValueError(f"document {i} has {lengths[i]} tokens > max_tokens*cp = {cap}")
    order = np.random.default_rng(seed).permutation(len(lengths))
    mbs = _deal_steps(_step_groups(order, lengths, topology.step_tokens, nb), lengths.tolist(), cap, topology)
    return Plan.from_flat_micro_batches(
        mbs,
        lengths,
        topology,
        cost,
        seed=seed,
        natural_step=natural_steps(order, lengths, topology.step_tokens),
        plan_seconds=time.perf_counter() - t0,
    )


def _step_groups(order: np.ndarray, lengths: np.ndarray, tokens_per_step: int, nb: int) -> list[tuple[int, list]]:
    """(step number, documents in shuffled order) of every step some document starts in: the shuffled order cut
    every `tokens_per_step` tokens; a last step of fewer than `nb` documents joins the step before it (again while
    the joined step is still short of `nb`)."""
    start_step = (np.cumsum(lengths[order]) - lengths[order]) // tokens_per_step  # nondecreasing
    ids, starts = np.unique(start_step, return_index=True)
    docs = order.tolist()
    bounds = starts.tolist() + [len(docs)]
    groups = [(int(s), docs[bounds[i] : bounds[i + 1]]) for i, s in enumerate(ids)]
    while len(groups) > 1 and len(groups[-1][1]) < nb:  # a tail too small to fill every micro-batch
        tail = groups.pop()[1]
        groups[-1][1].extend(tail)
    return groups


def _deal_steps(groups: list[tuple[int, list]], lengths: list, cap: int, topology: Topology) -> list[list[int]]:
    """The micro-batches of every step, step by step: a step's documents (those left over by the step before it
    first) dealt longest first (ties in order) to the least-filled micro-batch (the lowest index among equals);
    a document no micro-batch has room for moves to the next step (with no documents of its own when the step
    numbers skip). Micro-batch j goes to replica j % dp."""
    nb, dp, m = topology.bins_per_step, topology.dp, topology.micro_batches
    mbs: list[list[int]] = []
    carry: list[int] = []
    g, step = 0, 0
    while g < len(groups) or carry:
        if g < len(groups) and groups[g][0] <= step:
            docs = carry + groups[g][1]
            g += 1
        elif carry:  # a step number no document starts in: the leftovers alone
            docs = carry
        else:
            step = groups[g][0]
            continue
        bins, carry = _deal(docs, lengths, cap, nb)
        # the longest documents (dealt first) land on different replicas
        mbs.extend(bins[r::dp][k] for r in range(dp) for k in range(m))
        step += 1
    return mbs


def _deal(docs: list[int], lengths: list, cap: int, nb: int) -> tuple[list[list[int]], list[int]]:
    """(nb micro-batches, the documents that did not fit) for one step; no micro-batch is left empty while another
    holds two or more (the fullest by count gives its last document)."""
    bins: list[list[int]] = [[] for _ in range(nb)]
    loads = [(0, j) for j in range(nb)]  # a heap: the least-filled micro-batch, lowest index among equals
    carry = []
    for d in sorted(docs, key=lengths.__getitem__, reverse=True):  # stable: ties keep their order
        tokens, j = loads[0]
        if tokens + lengths[d] > cap:  # the least-filled has no room, so none has
            carry.append(d)
            continue
        bins[j].append(d)
        heapq.heapreplace(loads, (tokens + lengths[d], j))
    for j in range(nb):
        if not bins[j]:
            donor = max(range(nb), key=lambda k: len(bins[k]))
            bins[j].append(bins[donor].pop())
    return bins, carry
