"""Fixed batches on dynamic CP (`Topology(cp_sizes=...)`): the batch is balanced as a static plan on groups of one
size C (balancer.planning.batch.balance), then every micro-batch is cut into smaller aligned groups where that costs no
time, by the same cut as `balancer.plan` uses (balancer.planning.dynamic.plan). Group rules hold through the cut: a
document group kept on a rank stays on the ranks of its replica of size C (cuts never leave them), and a group kept
in one micro-batch puts its micro-batch back together when a cut would have parted it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.dynamic.plan import base_group_size, check_fits, largest_group_topology, split_groups
from balancer.planning.plans.plan import Plan
from balancer.planning.topology import Topology


def balance_dynamic(
    lengths: np.ndarray,
    topology: Topology,
    cost: CostModel,
    group_of_doc: np.ndarray,
    options: dict,
    static: Callable[..., Plan],
) -> Plan:
    """The dynamic-CP plan of a fixed batch (module docstring); `options` as batch.balance builds them;
    `static` is its static balancing (`balancer.planning.batch.balance.balance_static`, passed in: batch sits above this
    module)."""
    check_fits(lengths, topology, options["overflow"])
    unit_tokens = np.minimum(lengths, topology.largest_group * topology.max_tokens)
    steps = options["mini_batches"]
    per_step = replace(topology, tokens_per_step=min(topology.capacity, max(1, int(unit_tokens.sum()) // steps)))
    size = base_group_size(cost.cost(unit_tokens), unit_tokens, per_step)
    if options["has_groups"] and options["keep"] == "micro_batch":  # a group needs a CP group that holds it
        group_tokens = np.bincount(group_of_doc, weights=unit_tokens)
        holds = [s for s in topology.group_sizes if s * topology.max_tokens >= group_tokens.max()]
        size = max(size, min(holds) if holds else topology.largest_group)
    virtual = replace(largest_group_topology(topology, size), tokens_per_step=None)
    base = static(lengths, virtual, cost, group_of_doc, options)
    final = replace(topology, micro_batches=base.topology.micro_batches, tokens_per_step=base.topology.tokens_per_step)
    # (order, group start, group size, entry counts, slot pointer; later fields, such as group times, unused)
    order, group_start, group_size, counts, slot_ptr = split_groups(
        base, largest_group_topology(final, size), final, cost
    )[:5]
    if options["has_groups"] and options["keep"] == "micro_batch":
        order, group_start, group_size, counts, slot_ptr = _rejoin(
            order, group_start, group_size, counts, slot_ptr, group_of_doc[base.doc], size
        )
    return Plan(
        base.lengths,
        final,
        cost,
        base.doc[order],
        base.start[order],
        base.end[order],
        np.concatenate([[0], np.cumsum(counts)]),
        seed=options["seed"],
        dropped_tokens=base.dropped_tokens,
        groups=(group_start, group_size, slot_ptr),
    )


def _rejoin(order, group_start, group_size, counts, slot_ptr, entry_group, size: int):
    """Undo the cuts of every large-group micro-batch whose parts would share a document group: its parts become
    one group of `size` ranks again (entries in the base plan's order)."""
    ptr = np.concatenate([[0], np.cumsum(counts)])
    parts_of = [order[ptr[k] : ptr[k + 1]] for k in range(len(counts))]
    new_parts, new_start, new_size, new_ptr = [], [], [], [0]
    for slot in range(len(slot_ptr) - 1):
        by_replica: dict[int, list[int]] = {}
        for k in range(slot_ptr[slot], slot_ptr[slot + 1]):
            by_replica.setdefault(int(group_start[k]) // size, []).append(k)
        for replica, ks in by_replica.items():
            groups_per_part = [set(entry_group[parts_of[k]].tolist()) for k in ks]
            if len(ks) > 1 and sum(map(len, groups_per_part)) != len(set().union(*groups_per_part)):
                new_parts.append(np.sort(np.concatenate([parts_of[k] for k in ks])))
                new_start.append(replica * size)
                new_size.append(size)
                continue
            for k in ks:
                new_parts.append(parts_of[k])
                new_start.append(int(group_start[k]))
                new_size.append(int(group_size[k]))
        new_ptr.append(len(new_start))
    as_array = [np.asarray(a, dtype=np.int64) for a in (new_start, new_size, [len(p) for p in new_parts], new_ptr)]
    return (np.concatenate(new_parts), *as_array)
