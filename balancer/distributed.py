"""Fixed batches whose documents live on the ranks that made them (each rank holds its own rollouts): gather the
lengths, plan the same batch on every rank, and move the documents to the ranks that train them.

`balance_batch(local_lengths, topology, cost, group=...)` all-gathers every rank's lengths in rank order (global
document id = the rank's offset + its local index), runs `balancer.balance_batch` on the whole batch (the same
Plan on every rank: it is a deterministic function of its inputs) and returns this rank's send and receive lists.
`exchange(...)` then moves token tensors with one `all_to_all_single` (point-to-point sends where the backend has
no all-to-all). Which process trains what: with static CP the processes of the group are the replicas in order,
`world // dp` consecutive ranks per DP rank (`rank = dp_rank * cp + cp_rank` when `world == dp * cp`), and every
process of a replica receives the replica's documents (each CP rank then cuts its share with `PackedCollator`);
with dynamic CP (`cp_sizes`) the world is the pool (`dp * cp` processes, pool rank = rank) and a document goes to
every rank of the CP groups it is placed on.

torch is imported inside the functions (`import balancer.distributed` stays light).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from numpy.typing import ArrayLike

from balancer.planning.cost.model import CostModel
from balancer.planning.plans.plan import Plan
from balancer.planning.topology import Topology

if TYPE_CHECKING:  # torch is imported inside the functions
    import torch.distributed as dist

METHODS = ("auto", "all_to_all", "p2p")


def balance_batch(
    local_lengths: ArrayLike,
    topology: Topology,
    cost: CostModel,
    *,
    group: Optional[dist.ProcessGroup] = None,
    groups: Optional[ArrayLike] = None,
    **options: Any,
) -> tuple[Plan, list[list[int]], list[list[int]]]:
    """All-gather the lengths (and the document `groups`, ids shared by all ranks) of every rank's documents, plan
    the whole batch with `balancer.balance_batch(..., **options)` on every rank, and return `(plan, send, recv)`:
    `send[dest]` the local indices of this rank's documents that process `dest` trains, `recv[src]` the global ids
    of the documents this rank receives from process `src` (both ascending). Collective over `group`."""
    import torch.distributed as dist

    from balancer.planning.batch.balance import balance_batch as plan_batch

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problem, local, local_groups = None, np.zeros(0, dtype=np.int64), None
    try:
        local, local_groups = _check_local(local_lengths, groups, topology, cost)
    except (ValueError, TypeError) as e:
        problem = str(e)
    _agree(problem, _arguments(topology, cost, groups is not None, options), group, world)
    counts = _gather_sizes(len(local), group, world)
    lengths = _gather(local, counts, group)
    all_groups = None if local_groups is None else _gather(local_groups, counts, group)
    plan = plan_batch(lengths, topology, cost, groups=all_groups, **options)
    owner = np.repeat(np.arange(world), counts)
    offset = np.concatenate([[0], np.cumsum(counts)])
    receivers = _receivers(plan, world)
    send = [
        sorted(int(d - offset[rank]) for d in np.flatnonzero(owner == rank) if dest in receivers[d])
        for dest in range(world)
    ]
    recv = [sorted(int(d) for d in np.flatnonzero(owner == src) if rank in receivers[d]) for src in range(world)]
    return plan, send, recv


def _check_local(local_lengths, groups, topology, cost) -> tuple[np.ndarray, np.ndarray | None]:
    """This rank's lengths (int64; none is fine) and groups, checked as `balancer.balance_batch` checks them."""
    from balancer.planning.units import check_topology_and_cost, validate_lengths

    check_topology_and_cost(topology, cost)
    arr = np.asarray(local_lengths)
    local = np.zeros(0, dtype=np.int64) if arr.ndim == 1 and arr.size == 0 else validate_lengths(arr, "local_lengths")
    if groups is None:
        return local, None
    local_groups = np.asarray(groups)
    if local_groups.ndim != 1 or len(local_groups) != len(local):
        raise ValueError(
            f"groups must hold one group id per local document: got shape {local_groups.shape}, this rank has "
            f"{len(local)} documents"
        )
    if len(local_groups) and local_groups.dtype.kind not in "iu":
        raise ValueError(f"groups must hold integer group ids, got dtype {local_groups.dtype}")
    return local, local_groups.astype(np.int64)


def _arguments(topology, cost, has_groups: bool, options: dict) -> dict:
    """What must be equal on every rank for the plans to be equal, as comparable text."""
    return {
        "topology": repr(topology),
        "cost": repr(cost),
        "groups": "given" if has_groups else "None",
        **{name: repr(value) for name, value in sorted(options.items())},
    }


def _agree(problem: str | None, arguments: dict, group, world: int) -> None:
    """Collective: every rank learns every rank's input problem and arguments; if any rank's input was bad, or the
    ranks disagree on an argument, every rank raises the same ValueError naming the rank and the reason (instead
    of the others waiting in a collective the bad rank never joins)."""
    import torch.distributed as dist

    seen: list = [None] * world
    dist.all_gather_object(seen, (problem, arguments), group=group)
    bad = [(r, p) for r, (p, _) in enumerate(seen) if p is not None]
    if bad:
        more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
        raise ValueError(f"balancer.distributed.balance_batch: rank {bad[0][0]}: {bad[0][1]}{more}")
    for name in sorted({n for _, args in seen for n in args}):
        values = [args.get(name, "(not given)") for _, args in seen]
        if len(set(values)) > 1:
            other = next(r for r, v in enumerate(values) if v != values[0])
            raise ValueError(
                f"balancer.distributed.balance_batch: {name} differs between ranks (rank 0: {values[0]}, rank "
                f"{other}: {values[other]}); every rank must pass the same {name}"
            )


def _gather_sizes(count: int, group, world: int) -> np.ndarray:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, torch.tensor([count], dtype=torch.int64), group=group)
    return np.array([int(t) for t in out], dtype=np.int64)


def _gather(values: np.ndarray, counts: np.ndarray, group) -> np.ndarray:
    """Every rank's `values` (int64), concatenated in rank order (padded to the longest for all_gather)."""
    import torch
    import torch.distributed as dist

    longest = max(int(counts.max()), 1)
    mine = torch.zeros(longest, dtype=torch.int64)
    mine[: len(values)] = torch.from_numpy(values)
    out = [torch.zeros(longest, dtype=torch.int64) for _ in counts]
    dist.all_gather(out, mine, group=group)
    return np.concatenate([t[:c].numpy() for t, c in zip(out, counts)])


def _receivers(plan: Plan, world: int) -> list[set[int]]:
    """The processes that train each document (see the module docstring)."""
    t = plan.topology
    out: list[set[int]] = [set() for _ in range(plan.num_docs)]
    mb_of_entry = np.repeat(np.arange(len(plan.mb_ptr) - 1), np.diff(plan.mb_ptr))
    if plan.dynamic:
        if world != t.pool_size:
            raise ValueError(
                f"dynamic CP needs one process per pool rank: dp*cp = {t.pool_size}, the group has {world}"
            )
        group_start, group_size, _ = plan.group_arrays
        for d, k in zip(plan.doc, mb_of_entry):
            start = int(group_start[k])
            out[int(d)].update(range(start, start + int(group_size[k])))
        return out
    if world % t.dp:
        raise ValueError(f"the process group has {world} processes, not a multiple of dp={t.dp}")
    per = world // t.dp
    replica = (mb_of_entry // t.micro_batches) % t.dp
    for d, r in zip(plan.doc, replica):
        out[int(d)].update(range(int(r) * per, (int(r) + 1) * per))
    return out


def exchange(
    local_tensors: Sequence,
    send: list[list[int]],
    recv: list[list[int]],
    lengths: ArrayLike,
    *,
    group: Optional[dist.ProcessGroup] = None,
    method: str = "auto",
) -> dict:
    """Move documents as `balance_batch` planned: `local_tensors[i]` is this rank's document i (a tensor whose
    first dimension is its `lengths[global id]` tokens; all of one dtype and trailing shape). Returns
    `{global id: tensor}` of the documents this rank trains. `method`: "all_to_all" (one `all_to_all_single`),
    "p2p" (`batch_isend_irecv`), or "auto" (all-to-all, point-to-point where the backend refuses it).
    Collective over `group`."""
    import torch
    import torch.distributed as dist

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    sample = local_tensors[0] if len(local_tensors) else None
    pieces = [local_tensors[i] for dest in send for i in dest]
    if sample is None:  # nothing to send: take dtype and trailing shape from what arrives (int64 token ids)
        sample = torch.zeros(0, dtype=torch.int64)
    out_sizes = [int(lengths[ids].sum()) for ids in recv]
    in_sizes = [int(sum(local_tensors[i].shape[0] for i in dest)) for dest in send]
    trailing = tuple(sample.shape[1:])
    send_buf = torch.cat(pieces) if pieces else torch.zeros((0, *trailing), dtype=sample.dtype)
    recv_buf = torch.empty((sum(out_sizes), *trailing), dtype=send_buf.dtype)
    if method in ("auto", "all_to_all"):
        try:
            dist.all_to_all_single(recv_buf, send_buf, out_sizes, in_sizes, group=group)
            method = "done"
        except RuntimeError:
            if method == "all_to_all":
                raise
    if method != "done":
        _p2p(recv_buf, send_buf, out_sizes, in_sizes, group)
    got = {}
    for ids, chunk in zip(recv, torch.split(recv_buf, out_sizes)):
        for d, piece in zip(ids, torch.split(chunk, [int(lengths[i]) for i in ids])):
            got[int(d)] = piece
    return got


def _p2p(recv_buf, send_buf, out_sizes: list[int], in_sizes: list[int], group) -> None:
    """The all-to-all as point-to-point sends and receives (one batch), for backends without all_to_all."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(group)
    ops = []
    sends = torch.split(send_buf, in_sizes)
    recvs = torch.split(recv_buf, out_sizes)
    for peer, (outgoing, incoming) in enumerate(zip(sends, recvs)):
        global_peer = peer if group is None else dist.get_global_rank(group, peer)
        if peer == rank:
            incoming.copy_(outgoing)
            continue
        if outgoing.numel():
            ops.append(dist.P2POp(dist.isend, outgoing.contiguous(), global_peer, group))
        if incoming.numel():
            ops.append(dist.P2POp(dist.irecv, incoming, global_peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
