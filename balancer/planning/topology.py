"""Topology: the DP x CP x PP layout a plan is made for, with its per-micro-batch memory cap and step budget."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

DEFAULT_FILL = 0.85  # tokens_per_step when not given: this share of the capacity (the rest is planner slack)


@dataclass(frozen=True)
class Topology:
    """`dp` replicas, each a CP group of `cp` ranks feeding `pp` pipeline stages with `micro_batches` per step.

    `max_tokens` is per CP rank per micro-batch, so a micro-batch holds at most `max_tokens * cp` tokens.
    `tokens_per_step` is the global batch in tokens (default 85% of `capacity`); it may not exceed `capacity`.
    """

    dp: int
    cp: int = 1
    pp: int = 1
    micro_batches: int = 1
    max_tokens: int = 4096
    tokens_per_step: Optional[int] = None

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
        if self.tokens_per_step is None:
            object.__setattr__(self, "tokens_per_step", max(1, int(DEFAULT_FILL * self.capacity)))
        else:
            tps = self.tokens_per_step
            if isinstance(tps, bool) or int(tps) != tps or tps < 1:
                raise ValueError(f"Topology.tokens_per_step must be a positive integer, got {tps!r}")
            object.__setattr__(self, "tokens_per_step", int(tps))
            if self.tokens_per_step > self.capacity:
                raise ValueError(
                    f"Topology.tokens_per_step={self.tokens_per_step} exceeds the capacity "
                    f"dp*cp*micro_batches*max_tokens = {self.dp}*{self.cp}*{self.micro_batches}*{self.max_tokens}"
                    f" = {self.capacity}"
                )

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
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        return cls(
            **{k: data[k] for k in ("dp", "cp", "pp", "micro_batches", "max_tokens", "tokens_per_step") if k in data}
        )

    def __str__(self) -> str:
        return (
            f"dp{self.dp} x cp{self.cp} x pp{self.pp}, M={self.micro_batches}, max_tokens={self.max_tokens}, "
            f"tokens_per_step={self.tokens_per_step}"
        )
