"""Topology: the DP x CP x PP layout a plan is made for, with its per-micro-batch memory cap and step budget."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

MAX_CAPACITY = 2**53  # most tokens one step may hold (far beyond any cluster; keeps float64 token sums exact)
DEFAULT_FILL = 0.85  # tokens_per_step when not given: this share of the capacity (the rest is planner slack)


def _whole(value) -> bool:
    """A whole number (an int, or a finite float holding one); False for NaN, infinities and non-numbers."""
    try:
        return int(value) == value
    except (TypeError, ValueError, OverflowError):
        return False


@dataclass(frozen=True)
class Topology:
    """`dp` replicas, each a CP group of `cp` ranks feeding `pp` pipeline stages with `micro_batches` per step.

    `max_tokens` is per CP rank per micro-batch, so a micro-batch holds at most `max_tokens * cp` tokens.
    `tokens_per_step` is the global batch in tokens (default 85% of `capacity`); it may not exceed `capacity`.

    `cp_sizes` (dynamic CP): the `dp * cp` ranks of a pipeline stage form one pool (pool rank = dp_rank * cp +
    cp_rank); in every micro-batch slot the pool is cut into contiguous groups `[start, size]` with
    `start % size == 0` and `size` in `cp_sizes`, each group running one micro-batch of at most
    `size * max_tokens` tokens. Every size must divide `dp * cp`.

    `rank_speeds` (uneven ranks): the relative speed of each DP replica, `dp` positive finite floats (with
    `cp_sizes`: one per pool rank, `dp * cp`). The planner gives a replica work in proportion to its speed: its
    time is its work divided by its speed, and a CP group runs at its slowest member's speed. None: all equal.
    """

    dp: int
    cp: int = 1
    pp: int = 1
    micro_batches: int = 1
    max_tokens: int = 4096
    tokens_per_step: Optional[int] = None
    cp_sizes: Optional[tuple[int, ...]] = None
    rank_speeds: Optional[tuple[float, ...]] = None

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "pp", "micro_batches", "max_tokens"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int,))
                and not (hasattr(value, "__index__") and int(value) == value)
            ):
                raise ValueError(f"Topology.{name} must be an integer, got {value!r}")
            if int(value) < 1:
                raise ValueError(f"Topology.{name} must be >= 1, got {value}")
            object.__setattr__(self, name, int(value))
        if self.capacity > MAX_CAPACITY:  # token counts stay exact in int64 and float64 arithmetic
            raise ValueError(
                f"the capacity dp*cp*micro_batches*max_tokens = {self.dp}*{self.cp}*{self.micro_batches}*"
                f"{self.max_tokens} = {self.capacity} exceeds 2^53 tokens per step: lower Topology.max_tokens"
            )
        if self.tokens_per_step is None:
            object.__setattr__(self, "tokens_per_step", max(1, int(DEFAULT_FILL * self.capacity)))
        else:
            tps = self.tokens_per_step
            if isinstance(tps, (bool, str, bytes)) or not _whole(tps) or tps < 1:
                raise ValueError(f"Topology.tokens_per_step must be a positive integer, got {tps!r}")
            object.__setattr__(self, "tokens_per_step", int(tps))
            if self.tokens_per_step > self.capacity:
                raise ValueError(
                    f"Topology.tokens_per_step={self.tokens_per_step} exceeds the capacity "
                    f"dp*cp*micro_batches*max_tokens = {self.dp}*{self.cp}*{self.micro_batches}*{self.max_tokens}"
                    f" = {self.capacity}"
                )
        if self.cp_sizes is not None:
            object.__setattr__(self, "cp_sizes", self._check_cp_sizes(self.cp_sizes))
        if self.rank_speeds is not None:
            object.__setattr__(self, "rank_speeds", self._check_rank_speeds(self.rank_speeds))

    def _check_rank_speeds(self, speeds) -> tuple[float, ...]:
        if isinstance(speeds, (str, bytes, dict)) or not hasattr(speeds, "__iter__"):
            raise ValueError(f"Topology.rank_speeds must be a sequence of relative speeds, got {speeds!r}")
        speeds = list(speeds)
        want, what = (self.pool_size, "pool rank (dp*cp") if self.dynamic else (self.dp, "DP replica (dp")
        if len(speeds) != want:
            raise ValueError(f"Topology.rank_speeds has {len(speeds)} entries, but needs one per {what} = {want})")
        out = []
        for i, speed in enumerate(speeds):
            if isinstance(speed, bool) or not isinstance(speed, (int, float)) and not hasattr(speed, "__float__"):
                raise ValueError(f"Topology.rank_speeds[{i}] = {speed!r} is not a number")
            value = float(speed)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"Topology.rank_speeds[{i}] = {speed!r}: speeds must be positive finite numbers")
            out.append(value)
        return tuple(out)

    def _check_cp_sizes(self, sizes) -> tuple[int, ...]:
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
            raise ValueError(f"Topology.cp_sizes must be a sequence of group sizes, got {sizes!r}")
        sizes = list(sizes)
        if not sizes:
            raise ValueError("Topology.cp_sizes is empty: give at least one CP group size")
        pool = self.dp * self.cp
        for size in sizes:
            if isinstance(size, bool) or not hasattr(size, "__index__") or int(size) != size:
                raise ValueError(f"Topology.cp_sizes: {size!r} is not an integer group size")
            if int(size) < 1:
                raise ValueError(f"Topology.cp_sizes: size {size} is not allowed (group sizes must be >= 1)")
            if pool % int(size):
                raise ValueError(
                    f"Topology.cp_sizes: size {size} does not divide the pool of dp*cp = {self.dp}*{self.cp} = "
                    f"{pool} ranks"
                )
        return tuple(sorted({int(size) for size in sizes}))

    @property
    def dynamic(self) -> bool:
        """True when the CP groups change per micro-batch slot (`cp_sizes` is set)."""
        return self.cp_sizes is not None

    @property
    def step_tokens(self) -> int:
        """`tokens_per_step` as the constructor filled it in (an int on every built Topology)."""
        assert self.tokens_per_step is not None, "__post_init__ fills tokens_per_step in"
        return self.tokens_per_step

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """The CP group sizes a plan may use: `cp_sizes` with dynamic CP, else `(cp,)`."""
        return self.cp_sizes if self.cp_sizes is not None else (self.cp,)

    @property
    def pool_size(self) -> int:
        """Ranks of one pipeline stage: dp * cp (the pool dynamic CP partitions in every slot)."""
        return self.dp * self.cp

    @property
    def largest_group(self) -> int:
        """The largest CP group a plan may use: max(cp_sizes), or cp."""
        return max(self.cp_sizes) if self.cp_sizes else self.cp

    @property
    def micro_batch_tokens(self) -> int:
        """Token cap of one micro-batch (summed over its CP group)."""
        return self.max_tokens * self.cp

    @property
    def bins_per_step(self) -> int:
        """Micro-batches per step over all replicas: dp * micro_batches."""
        return self.dp * self.micro_batches

    @property
    def capacity(self) -> int:
        """Most tokens one step can hold: dp * cp * micro_batches * max_tokens."""
        return self.dp * self.cp * self.micro_batches * self.max_tokens

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.cp_sizes is None:
            del data["cp_sizes"]  # static topologies keep their original record
        else:
            data["cp_sizes"] = list(self.cp_sizes)
        if self.rank_speeds is None:
            del data["rank_speeds"]  # even ranks keep the record they always had
        else:
            data["rank_speeds"] = list(self.rank_speeds)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        if not isinstance(data, dict):
            raise ValueError(f"a topology record must be an object, got {type(data).__name__}")
        keys = ("dp", "cp", "pp", "micro_batches", "max_tokens", "tokens_per_step", "cp_sizes", "rank_speeds")
        return cls(**{k: data[k] for k in keys if k in data and data[k] is not None})

    def __str__(self) -> str:
        return (
            f"dp{self.dp} x cp{self.cp} x pp{self.pp}, M={self.micro_batches}, max_tokens={self.max_tokens}, "
            f"tokens_per_step={self.tokens_per_step}"
            + (f", cp_sizes={list(self.cp_sizes)}" if self.cp_sizes else "")
            + (f", rank_speeds={list(self.rank_speeds)}" if self.rank_speeds else "")
        )
