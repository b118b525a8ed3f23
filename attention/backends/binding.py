"""Binding a kernel function by parameter names: :func:`signature_params` reads a Python function's (or a
``torch.library`` custom op's) parameters, :class:`ArgAdapter` fills them from our values, aliases and neutral
values, and refuses a signature it cannot fill when it is built, naming the parameter."""

from __future__ import annotations

import inspect
from collections.abc import Callable

# our value name -> parameter names that take it, in the kernels' spellings
ALIASES = {
    "causal": ("causal", "is_causal"),
    "seqused_q": ("seqused_q", "sequed_q"),
    "seqused_k": ("seqused_k", "sequed_k"),
}


def signature_params(fn: Callable) -> dict:
    """Parameters of ``fn`` (or of the Python function a ``torch.library`` custom op wraps); {} if unknown."""
    for cand in (getattr(fn, "_init_fn", None), fn):
        if cand is None:
            continue
        try:
            params = inspect.signature(cand).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
            return dict(params)
    return {}


class ArgAdapter:
    """Builds keyword arguments for one kernel function from our values. ``error`` is "" when the signature is
    usable, else why not (a meaningful argument without a parameter, or a parameter without a default that nothing
    fills); ``has_window`` / ``has_softcap`` say which masks it can take. ``fills``: the names values will carry
    (ours and the neutral ones); ``aliases``: our name -> parameter names."""

    def __init__(self, params: dict, required: tuple[str, ...], fills=None, aliases=None) -> None:
        self.aliases = ALIASES if aliases is None else aliases
        self.params = {n: p for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        names = set(self.params)
        self.window_style = (
            "pair" if {"window_size_left", "window_size_right"} <= names else "tuple" if "window_size" in names else ""
        )
        self.has_window = bool(self.window_style)
        self.has_softcap = "softcap" in names
        missing = [r for r in required if not (set(self.aliases.get(r, (r,))) & names)]
        self.error = f"no parameter for {missing}" if missing else ""
        if fills is not None and not self.error:
            takes = {n for ours in set(fills) | {"window", "softcap"} for n in self._names(ours)}
            unfilled = [n for n, p in self.params.items() if p.default is inspect.Parameter.empty and n not in takes]
            if unfilled:
                self.error = f"parameter {unfilled[0]!r} has no default and no value the project can give it"
        if not self.params:
            self.error = "signature unreadable"

    def _names(self, ours: str) -> tuple[str, ...]:
        if ours == "window":
            return ("window_size", "window_size_left", "window_size_right")
        return self.aliases.get(ours, (ours,))

    def kwargs(self, values: dict) -> dict:
        """Keyword arguments for the kernel; raises RuntimeError if a parameter without default has no value or a
        mask the kernel cannot take was asked for."""
        window = values.pop("window", (-1, -1))
        softcap = values.pop("softcap", 0.0)
        if tuple(window) != (-1, -1) and not self.has_window:
            raise RuntimeError("this kernel version takes no sliding window")
        if softcap and not self.has_softcap:
            raise RuntimeError("this kernel version takes no softcap")
        values = dict(values, softcap=softcap, window_size=tuple(window))
        values.update(window_size_left=window[0], window_size_right=window[1])
        by_param: dict[str, object] = {}
        for ours, val in values.items():
            for name in self.aliases.get(ours, (ours,)):
                by_param.setdefault(name, val)
        kw = {}
        for name, p in self.params.items():
            if name in by_param:
                kw[name] = by_param[name]
            elif p.default is inspect.Parameter.empty:
                raise RuntimeError(f"kernel parameter {name!r} has no value (signature {list(self.params)})")
        return kw
