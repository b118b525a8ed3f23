"""The options of a `balancer pretokenize` job that decide its output bytes, and the choices the command line
offers (light: the parser reads them without importing the pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.limits import check_count, optional_count
from balancer.limits import DEFAULT_SHARD_TOKENS, MAX_LENGTH, MAX_SHARD_TOKENS

OVERFLOW_CHOICES = ("split", "truncate", "drop")
ON_ERROR_CHOICES = ("fail", "skip")
ENGINES = ("local", "ray")


@dataclass
class PretokenizeOptions:
    """Options that decide the output bytes (all part of the job identity)."""

    text_field: str = "text"
    max_length: Optional[int] = None
    overflow: str = "split"
    add_eos: bool = False
    on_error: str = "fail"
    shard_tokens: int = DEFAULT_SHARD_TOKENS

    def check(self) -> None:
        """DataError naming the first option out of its range (limits: `balancer.data.shards.limits`)."""
        if self.overflow not in OVERFLOW_CHOICES:
            raise DataError(f"{arg('overflow')} must be one of {OVERFLOW_CHOICES}, got {self.overflow!r}")
        if self.on_error not in ON_ERROR_CHOICES:
            raise DataError(f"{arg('on_error')} must be fail or skip, got {self.on_error!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise DataError(f"{arg('text_field')} must be a non-empty string, got {self.text_field!r}")
        if not isinstance(self.add_eos, bool):
            raise DataError(f"{arg('add_eos')} must be True or False, got {self.add_eos!r}")
        optional_count("max_length", self.max_length, 1, MAX_LENGTH)
        check_count("shard_tokens", self.shard_tokens, 1, MAX_SHARD_TOKENS)
