"""Which rank a sampler is: its pool rank (`dp_rank * cp + cp_rank`) and DP rank from the arguments, a device mesh
or torch.distributed (DP outermost)."""

from __future__ import annotations

import numbers
from typing import Any, Optional

from balancer.planning.topology import Topology


def _checked_index(name: str, value: object, bound: int, what: str) -> int:
    """`value` as an int in 0 .. bound-1: an integer that is not a bool (numpy integers too); a ValueError naming
    `name` otherwise (a float, NaN or inf included: `int()` of them gave other errors or silently truncated)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < bound:
        raise ValueError(
            f"{name} must be an integer in 0 .. {bound - 1} ({what}): {type(value).__name__} {value!r} is out of range "
            "or not an integer"
        )
    return int(value)


def resolve_pool_rank(
    rank: Optional[int], dp_rank: Optional[int], topology: Topology, device_mesh: Any, dp_dim: str
) -> int:
    """This rank's pool rank (`dp_rank * cp + cp_rank`) from `rank`, or `dp_rank` / the device mesh /
    torch.distributed as `resolve_dp_rank` finds it (CP rank from torch.distributed when initialised, else 0)."""
    if rank is not None:
        rank = _checked_index("rank", rank, topology.pool_size, f"a pool of dp*cp = {topology.pool_size} ranks")
        if (
            dp_rank is not None
            and _checked_index("dp_rank", dp_rank, topology.dp, f"dp={topology.dp}") != rank // topology.cp
        ):
            raise ValueError(f"dp_rank {dp_rank} and pool rank {rank} disagree (pool rank = dp_rank*cp + cp_rank)")
        return int(rank)
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if topology.dynamic and dp_rank is None and device_mesh is None and not initialised:
        if topology.pool_size == 1:
            return 0
        raise ValueError(
            "with dynamic CP (cp_sizes) pass rank= (the pool rank dp_rank*cp + cp_rank) or initialise torch.distributed"
        )
    dp = resolve_dp_rank(dp_rank, topology, device_mesh, dp_dim)
    if dp_rank is None and device_mesh is None and initialised:
        return dist.get_rank() // topology.pp
    if topology.dynamic and topology.cp > 1:
        raise ValueError("with dynamic CP and cp > 1 the CP rank is needed too: pass rank= (dp_rank*cp + cp_rank)")
    return dp * topology.cp


def resolve_dp_rank(dp_rank: Optional[int], topology: Topology, device_mesh: Any, dp_dim: str) -> int:
    if dp_rank is not None:
        return _checked_index("dp_rank", dp_rank, topology.dp, f"dp={topology.dp}")
    if device_mesh is not None:
        size = device_mesh.size(device_mesh.mesh_dim_names.index(dp_dim)) if device_mesh.mesh_dim_names else None
        if size != topology.dp:
            raise ValueError(f"the device mesh's {dp_dim!r} dimension has {size} ranks, topology has dp={topology.dp}")
        return int(device_mesh.get_local_rank(dp_dim))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(
                f"torch.distributed has {world} ranks but the topology needs dp*cp*pp = "
                f"{topology.world_size}; pass dp_rank= or device_mesh="
            )
        return dist.get_rank() // (topology.cp * topology.pp)
    if topology.dp == 1:
        return 0
    raise ValueError(f"dp_rank is not given and torch.distributed is not initialised (topology has dp={topology.dp})")
