"""CP process groups for a topology: every group a plan may run a micro-batch on, keyed by `(start, size)`.

Ranks are laid out DP outermost, then CP, then pipeline stages: global rank = `pool_rank * pp + stage`, pool rank =
`dp_rank * cp + cp_rank`. A group `(start, size)` holds pool ranks `[start, start + size)` of this rank's stage.
"""

from __future__ import annotations

from balancer.planning.topology import Topology


def group_keys(topology: Topology) -> list[tuple[int, int]]:
    """Every `(start, size)` a plan for `topology` may use: static, one per replica `(dp_rank * cp, cp)`; dynamic,
    every aligned group of every size in `cp_sizes`."""
    if topology.cp_sizes is None:  # static CP
        return [(d * topology.cp, topology.cp) for d in range(topology.dp)]
    return [(start, size) for size in topology.cp_sizes for start in range(0, topology.pool_size, size)]


def cp_groups(topology: Topology, backend: str | None = None) -> dict:
    """Create (collectively: every rank must call it, in the same order) the process group of every CP group a
    plan may use, for every pipeline stage; returns this rank's: `{(start, size): ProcessGroup}` for the groups
    that hold it. Use as `cp_attention(..., group=groups[batch["cp_group_key"]])`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("balancer.cp_groups needs torch.distributed to be initialised")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise ValueError(f"torch.distributed has {world} ranks but the topology needs dp*cp*pp = {topology.world_size}")
    pp = topology.pp
    rank = dist.get_rank()
    pool_rank, stage = divmod(rank, pp)
    out = {}
    for st in range(pp):
        for start, size in group_keys(topology):
            group = dist.new_group([(start + i) * pp + st for i in range(size)], backend=backend)
            if st == stage and start <= pool_rank < start + size:
                out[(start, size)] = group
    return out
