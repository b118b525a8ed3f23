"""The plan's shape from what torchtitan's trainer gives its data loader.

torchtitan builds the loader with `dp_world_size` (its batch ranks), `dp_rank`, `seq_len` and `local_batch_size`
(the pipeline's micro-batch size under PP), and pulls `global_batch_size // (dp_world_size * local_batch_size)`
items per optimizer step (its gradient accumulation steps times its pipeline micro-batches: both reduce to this).
The plan follows it:

- `micro_batches` = that count, from `Config.global_batch_size` (the trainer's `training.global_batch_size`;
  -1, its default, means one item per step);
- CP: torchtitan's own CP stays off; `Config.cp_degree = c` groups its batch ranks into CP groups of `c`
  consecutive ranks (`dp = dp_world_size // c`, `dp_rank = rank // c`, `cp_rank = rank % c`), and
  `PackedAttention` computes attention over the group;
- `max_tokens` (per CP rank) = `local_batch_size * seq_len // c`: a micro-batch holds as many tokens as torchtitan's
  `[local_batch_size, seq_len]` item, cut into `c` shares, as torchtitan's CP cuts a sequence;
- `tokens_per_step`: `Config.tokens_per_step`, else the project's default share of the capacity.
"""

from __future__ import annotations

from typing import Optional

from balancer.planning.topology import Topology


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def items_per_step(global_batch_size: int, dp_world_size: int, local_batch_size: int) -> int:
    """Items the trainer pulls per optimizer step (`global_batch_size == -1`: one)."""
    if global_batch_size == -1:
        return 1
    _positive("BalancedDataLoader.Config.global_batch_size", global_batch_size)
    per = dp_world_size * local_batch_size
    if global_batch_size % per:
        raise ValueError(
            f"BalancedDataLoader.Config.global_batch_size={global_batch_size} is not a multiple of dp_world_size x "
            f"local_batch_size = {dp_world_size} x {local_batch_size}: set it to the trainer's "
            "training.global_batch_size, which torchtitan requires to divide so"
        )
    return global_batch_size // per


def plan_topology(
    *,
    dp_world_size: int,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    cp_degree: int,
    pp_degree: int,
    tokens_per_step: Optional[int],
) -> Topology:
    """The `Topology` of the module docstring."""
    for name, value in (("dp_world_size", dp_world_size), ("seq_len", seq_len), ("local_batch_size", local_batch_size),
                        ("Config.cp_degree", cp_degree), ("Config.pp_degree", pp_degree)):  # fmt: skip
        _positive(name, value)
    if dp_world_size % cp_degree:
        raise ValueError(
            f"BalancedDataLoader.Config.cp_degree={cp_degree} does not divide the trainer's dp_world_size "
            f"{dp_world_size} (its batch ranks, grouped into CP groups of cp_degree)"
        )
    if (local_batch_size * seq_len) % cp_degree:
        raise ValueError(f"local_batch_size x seq_len = {local_batch_size * seq_len} is not a multiple of cp_degree "
                         f"{cp_degree}")  # fmt: skip
    return Topology(
        dp=dp_world_size // cp_degree,
        cp=cp_degree,
        pp=pp_degree,
        micro_batches=items_per_step(global_batch_size, dp_world_size, local_batch_size),
        max_tokens=local_batch_size * seq_len // cp_degree,
        tokens_per_step=tokens_per_step,
    )
