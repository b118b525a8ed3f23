"""The class the Trainer mixins are type-checked against: `transformers.Trainer` for the type checker, `object` at
run time (each mixin is mixed into a Trainer subclass, whose attributes and hooks it uses and overrides; importing
this module imports no transformers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Trainer as TrainerHost
else:
    TrainerHost = object

__all__ = ["TrainerHost"]
