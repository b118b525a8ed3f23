"""Lazy re-exports for the package ``__init__`` files of both `attention` and `balancer` (it lives in the lower of the
two packages so that both can use it): a public name is imported from its home module on first use, so
``import balancer`` stays light (no torch, scipy, pyarrow or datasets until an object that needs them is used)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(
    package: str, exports: dict[str, str], moved: dict[str, str] | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for `package`: `exports` maps a public name to the module that defines it (a name
    that equals the module's last component is the module itself, as ``balancer.loss``); `moved` maps a name this
    package no longer exports to the package that does, named in the AttributeError."""

    def __getattr__(name: str) -> object:
        home = exports.get(name)
        if home is None:
            if moved and name in moved:
                raise AttributeError(f"{package}.{name} moved: use {moved[name]}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home)
        value = module if home.rsplit(".", 1)[-1] == name else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
