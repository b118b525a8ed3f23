"""One rank's micro-batches of a given `Plan` as dataset indices (what a batch sampler yields): the fixed batches
of evaluation and post-training (`balancer.balance_batch`), where the whole plan is known in advance.

Whole documents are ints (dynamic CP: `Member`s carrying the micro-batch's `CPGroup`), parts of documents `Span`s,
exactly as `BalancedBatchSampler` yields them, so `SpanDataset` + `PackedCollator` take them unchanged.
"""

from __future__ import annotations

from balancer.planning.plans.plan import Plan
from balancer.training.indices import CPGroup, Member, Span


def plan_micro_batches(plan: Plan, rank: int) -> list[list]:
    """Every micro-batch pool rank `rank` (= dp_rank * cp + cp_rank) runs in `plan`, step by step, in order: a list
    of index lists. The CP ranks of one group get the same indices (each shards the packed batch itself)."""
    t = plan.topology
    if not 0 <= rank < t.pool_size:
        raise ValueError(f"rank {rank} out of range for dp*cp = {t.dp}*{t.cp} = {t.pool_size} ranks")
    if plan.dynamic:
        out = []
        group_start, group_size, _ = plan.group_arrays
        for k in plan.rank_groups(rank):
            start, size = int(group_start[k]), int(group_size[k])
            out.append(_indices(plan, int(k), CPGroup(start, size, rank - start)))
        return out
    dp_rank = rank // t.cp
    ks = [
        s * t.bins_per_step + dp_rank * plan.step_micro_batches(s) + m
        for s in range(plan.num_steps)
        for m in range(plan.step_micro_batches(s))
    ]
    return [_indices(plan, k, None) for k in ks]


def _indices(plan: Plan, k: int, group) -> list:
    a, b = int(plan.mb_ptr[k]), int(plan.mb_ptr[k + 1])
    out: list = []
    for d, s, e in zip(plan.doc[a:b].tolist(), plan.start[a:b].tolist(), plan.end[a:b].tolist()):
        if s == 0 and e == int(plan.lengths[d]):
            out.append(d if group is None else Member(d, group))
        else:
            out.append(Span(d, s, e, group))
    return out
