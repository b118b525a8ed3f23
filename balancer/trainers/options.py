"""Checks of the balanced trainers' plain options at construction, one line naming the argument: `cp_method` and
`attention_backend` were only read at the first CP attention call (a typo or a NaN trained until then, or for ever
without CP), and `filler_rows` took any value as a truth value."""

from __future__ import annotations

from typing import Any

from attention.backends.base import Backend
from attention.backends.select import BACKENDS
from attention.cp import METHODS


def check_trainer_options(*, cp_method: Any, attention_backend: Any, filler_rows: Any) -> None:
    """`cp_method` one of attention's CP methods, `attention_backend` one of its backend names or a `Backend`,
    `filler_rows` a bool; a ValueError naming the argument otherwise."""
    if not isinstance(cp_method, str) or cp_method not in METHODS:
        raise ValueError(f"cp_method must be one of {METHODS}, got {type(cp_method).__name__} {cp_method!r}")
    if not isinstance(attention_backend, Backend) and (
        not isinstance(attention_backend, str) or attention_backend not in BACKENDS
    ):
        raise ValueError(
            f"attention_backend must be one of {BACKENDS} or an attention Backend, got "
            f"{type(attention_backend).__name__} {attention_backend!r}"
        )
    if not isinstance(filler_rows, bool):
        raise ValueError(f"filler_rows must be True or False, got {type(filler_rows).__name__} {filler_rows!r}")
