"""One step of the failure-free run planned over the replica groups that contribute to it.

The failure-free run's step (its pieces: whole documents and split documents' spans, fixed by the window plan on
`topology`) keeps its tokens whatever the number of groups: `balancer.balance_batch` plans the pieces over the `k`
contributors with at least `ceil(dp * M / k)` micro-batches each (fewer groups take more; fewer when the step has
fewer pieces than that: none is left empty), every piece fitting a micro-batch (the window plan made them fit),
each group's share in proportion to its speed when speeds are given (the micro-batch count, the same for every
group, then lets the fastest hold its share: a slow group's micro-batches are emptier). No group runs more
micro-batches than the failure-free step has in all (`dp * M`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from balancer.planning.batch.balance import balance_batch
from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.training.indices import Span

__all__ = ["StepPieces", "StepPlan", "plan_step"]

_PACKING_SLACK = 1.15  # micro-batches are rarely filled to the last token: room for the fastest group's share


@dataclasses.dataclass(frozen=True)
class StepPieces:
    """The pieces of one failure-free step: `doc`, `[start, end)` and each document's whole length `full`, and
    the micro-batches every replica runs in it on the failure-free topology (`micro_batches`: M, or M' in a short
    last step)."""

    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    full: np.ndarray
    micro_batches: int

    @property
    def loss_tokens(self) -> int:
        """Sum over the pieces of `tokens - 1` (the sampler's `step_loss_tokens`)."""
        return int((self.end - self.start - 1).sum())

    @property
    def tokens(self) -> int:
        return int((self.end - self.start).sum())

    def item(self, i: int, a: int, b: int) -> int | Span:
        """The index the sampler yields for tokens `[a, b)` of piece `i`: the document id when it is the whole
        document, else a `Span`."""
        s, e = int(self.start[i]) + a, int(self.start[i]) + b
        d = int(self.doc[i])
        return d if (s == 0 and e == int(self.full[i])) else Span(d, s, e)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """`items[i]`: contributor `i`'s micro-batches (lists of sampler indices; empty micro-batches left out);
    `times[i]`: its predicted time (cost units per CP rank, divided by its speed); `imbalance`: the plan's
    predicted imbalance (balancer's metric: slowest over the bound); `micro_batches`: micro-batches per group."""

    items: list
    times: np.ndarray
    costs: np.ndarray
    imbalance: float
    micro_batches: int


def plan_step(
    pieces: StepPieces,
    topology: Topology,
    cost: CostModel,
    contributors: int,
    speeds: Optional[tuple[float, ...]],
    seed: int,
) -> StepPlan:
    """Plan `pieces` over `contributors` replica groups (module docstring); deterministic in its arguments. When no
    equal micro-batch count per group both holds the tokens and leaves no micro-batch empty (a step of few long
    pieces over a number of groups that does not divide them), the pieces are packed into micro-batches alone and
    dealt to the groups by finish time (`_deal`): the groups then run different numbers of micro-batches."""
    t = topology
    share = 1 / contributors if speeds is None else max(speeds) / sum(speeds)  # the fastest group's part of the step
    room = math.ceil(_PACKING_SLACK * pieces.tokens * share / t.micro_batch_tokens)  # its tokens, with slack
    m = max(1, min(max(math.ceil(t.dp * pieces.micro_batches * share - 1e-9), room), len(pieces.doc) // contributors))
    sub = Topology(dp=contributors, cp=t.cp, pp=t.pp, micro_batches=m, max_tokens=t.max_tokens, rank_speeds=speeds)
    try:
        plan = balance_batch(pieces.end - pieces.start, sub, cost, micro_batches="auto", seed=seed)
    except ValueError:
        return _deal(pieces, t, cost, contributors, speeds, seed)
    mq = plan.step_micro_batches(0)
    if mq > t.dp * pieces.micro_batches:  # more than the failure-free step has in all: no group runs more
        return _deal(pieces, t, cost, contributors, speeds, seed)
    bins = [_items(pieces, plan, k) for k in range(contributors * mq)]
    items = [[mb for mb in bins[r * mq : (r + 1) * mq] if mb] for r in range(contributors)]
    costs = plan.micro_batch_costs()[0].sum(axis=1) / t.cp
    times = costs / (np.ones(contributors) if speeds is None else np.asarray(speeds))
    return StepPlan(items, times, costs, float(plan.metrics()["imbalance"]), mq)


def _items(pieces: StepPieces, plan, k: int) -> list:
    """Micro-batch `k` of `plan` (over the pieces) as sampler indices."""
    a, z = int(plan.mb_ptr[k]), int(plan.mb_ptr[k + 1])
    return [pieces.item(int(i), int(s), int(e)) for i, s, e in zip(plan.doc[a:z], plan.start[a:z], plan.end[a:z])]


def _deal(pieces: StepPieces, t: Topology, cost: CostModel, k: int, speeds, seed: int) -> StepPlan:
    """The pieces packed into `bins` balanced micro-batches (as many as the failure-free step has, at most one per
    piece), dealt largest first to the group that would finish it first."""
    bins = max(1, min(len(pieces.doc), t.dp * pieces.micro_batches))
    flat = Topology(dp=bins, cp=t.cp, micro_batches=1, max_tokens=t.max_tokens)
    plan = balance_batch(pieces.end - pieces.start, flat, cost, micro_batches=1, seed=seed)
    mb_cost = plan.micro_batch_costs()[0, :, 0] / t.cp
    s = np.ones(k) if speeds is None else np.asarray(speeds)
    costs = np.zeros(k)
    items: list[list] = [[] for _ in range(k)]
    for j in np.argsort(-mb_cost, kind="stable"):
        r = int(np.argmin((costs + mb_cost[j]) / s))
        costs[r] += mb_cost[j]
        items[r].append(_items(pieces, plan, int(j)))
    times = costs / s
    bound = max(float(mb_cost.sum() / s.sum()), float(mb_cost.max() / s.max()))
    return StepPlan(items, times, costs, float(times.max() / bound) if bound > 0 else 1.0, max(map(len, items)))
