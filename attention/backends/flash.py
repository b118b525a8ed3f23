"""flash-attn packages: flash-attn 2.x (``flash_attn.flash_attn_interface``) and flash-attn 3 (the Hopper
interface ``flash_attn_interface``), through their private varlen forward/backward functions.

Those functions drifted across releases (2.5: ``window_size`` tuple, no softcap, 8 return values; 2.6: + softcap;
2.7/2.8: ``window_size_left/right``, 4 return values; flash-attn 3: one ``_flash_attn_forward`` taking
``cu_seqlens_*``, ``is_causal`` in its backward). Arguments are matched by name from ``inspect.signature`` through
an alias table, results by tuple length, never by version string; a signature is accepted only if every argument that
carries meaning (queries, lengths, scale, the causal flag, the window when one is asked, deterministic) has a
parameter to go to and every parameter without a default gets a value, so nothing is silently dropped.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from typing import Optional

import torch

from attention.backends.varlen_cuda import VarlenCUDABackend, deterministic

log = logging.getLogger(__name__)

# our value name -> parameter names that take it, in the kernels' spellings
ALIASES = {
    "causal": ("causal", "is_causal"),
    "dout": ("dout",),
    "softmax_lse": ("softmax_lse",),
    "seqused_q": ("seqused_q", "sequed_q"),
    "seqused_k": ("seqused_k", "sequed_k"),
}
REQUIRED_FWD = (
    "q",
    "k",
    "v",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "softmax_scale",
    "causal",
)
REQUIRED_BWD = REQUIRED_FWD + ("dout", "out", "softmax_lse", "dq", "dk", "dv", "deterministic")


def signature_params(fn) -> dict:
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
    usable, else why not; ``has_window`` / ``has_softcap`` say which masks it can take."""

    def __init__(self, params: dict, required: tuple[str, ...]) -> None:
        self.params = {n: p for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        names = set(self.params)
        self.window_style = (
            "pair" if {"window_size_left", "window_size_right"} <= names else "tuple" if "window_size" in names else ""
        )
        self.has_window = bool(self.window_style)
        self.has_softcap = "softcap" in names
        missing = [r for r in required if not (set(ALIASES.get(r, (r,))) & names)]
        self.error = f"no parameter for {missing}" if missing else ""
        if not self.params:
            self.error = "signature unreadable"

    def kwargs(self, values: dict) -> dict:
        """Keyword arguments for the kernel; raises RuntimeError if a parameter without default has no value or a
        mask the kernel cannot take was asked for."""
        window = values.pop("window", (-1, -1))
        softcap = values.pop("softcap", 0.0)
        if tuple(window) != (-1, -1) and not self.has_window:
            raise RuntimeError("this flash-attn version takes no sliding window")
        if softcap and not self.has_softcap:
            raise RuntimeError("this flash-attn version takes no softcap")
        values = dict(values, softcap=softcap, window_size=tuple(window))
        values.update(window_size_left=window[0], window_size_right=window[1])
        by_param = {}
        for ours, val in values.items():
            for name in ALIASES.get(ours, (ours,)):
                by_param.setdefault(name, val)
        kw = {}
        for name, p in self.params.items():
            if name in by_param:
                kw[name] = by_param[name]
            elif p.default is inspect.Parameter.empty:
                raise RuntimeError(f"flash-attn parameter {name!r} has no value (signature {list(self.params)})")
        return kw


_NEUTRAL = dict(
    dropout_p=0.0, return_softmax=False, alibi_slopes=None, block_table=None, leftpad_k=None, seqused_k=None,
    seqused_q=None, zero_tensors=False, rng_state=None,
)  # fmt: skip


def _installed(mod_name: str) -> bool:
    """Whether the top-level package of ``mod_name`` is installed (found on the path), without importing it."""
    try:
        return importlib.util.find_spec(mod_name.split(".")[0]) is not None
    except (ImportError, ValueError):  # a broken parent package or an odd sys.modules entry
        return True


def _load(modules: tuple[str, ...], fwd_names: tuple[str, ...], bwd_names: tuple[str, ...]) -> tuple[list, list]:
    """(every (module, forward fn, backward fn) found, in preference order; why each installed module failed).

    A package that is not installed is skipped quietly (debug log). One that is installed but whose import raises
    (a broken CUDA extension, a torch/ABI mismatch, a missing dependency) is logged as a warning with the exception
    and reported in the failures, so the backend's refusal says why instead of silently falling back."""
    found, failures = [], []
    for mod_name in modules:
        if not _installed(mod_name):
            log.debug("%s is not installed", mod_name)
            continue
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:  # noqa: BLE001 - any import-time error of an installed kernel package is reported
            failures.append(f"{mod_name} is installed but its import failed: {type(e).__name__}: {e}")
            log.warning("%s is installed but its import failed; its kernels are unavailable", mod_name, exc_info=e)
            continue
        for fn_name, bn_name in zip(fwd_names, bwd_names):
            fwd, bwd = getattr(mod, fn_name, None), getattr(mod, bn_name, None)
            if fwd is not None and bwd is not None:
                found.append((mod_name, fwd, bwd))
    return found, failures


class _FlashPackageBackend(VarlenCUDABackend):
    """A flash-attn package bound through :class:`ArgAdapter`s; ``functions`` (forward, backward) may be given
    (tests pass stand-ins with recorded signatures), else they are imported."""

    modules: tuple[str, ...] = ()
    fwd_names: tuple[str, ...] = ()
    bwd_names: tuple[str, ...] = ()
    min_capability = (8, 0)

    def __init__(self, functions: Optional[tuple] = None) -> None:
        self.problem = ""
        self._fwd_fn = self._bwd_fn = None
        self.source = ""
        failures: list = []
        if functions is not None:
            candidates = [("given", *functions)]
        else:
            candidates, failures = _load(self.modules, self.fwd_names, self.bwd_names)
        if not candidates:
            self.problem = "; ".join(failures) if failures else f"{self.name} is not installed"
            return
        for self.source, *functions in candidates:
            self.fwd_adapter = ArgAdapter(signature_params(functions[0]), REQUIRED_FWD)
            self.bwd_adapter = ArgAdapter(signature_params(functions[1]), REQUIRED_BWD)
            bad = self.fwd_adapter.error or self.bwd_adapter.error
            if not bad:
                break
        if bad:
            self.problem = f"{self.name}: unsupported kernel signature in {self.source} ({bad})"
            return
        self.has_window = self.fwd_adapter.has_window and self.bwd_adapter.has_window
        self.has_softcap = self.fwd_adapter.has_softcap and self.bwd_adapter.has_softcap
        self._fwd_fn, self._bwd_fn = functions

    def available(self) -> bool:
        return self._fwd_fn is not None

    def why_not(self, q, k, window: bool = False, softcap: bool = False) -> str:
        if self.problem:
            return self.problem
        if q.is_cuda and torch.cuda.get_device_capability(q.device) < self.min_capability:
            return f"{self.name} needs compute capability {self.min_capability}"
        return super().why_not(q, k, window, softcap)

    @staticmethod
    def values(pk, causal, window, softcap, scale) -> dict:
        return dict(
            _NEUTRAL, cu_seqlens_q=pk.cu_q, cu_seqlens_k=pk.cu_k, max_seqlen_q=pk.max_q, max_seqlen_k=pk.max_k,
            softmax_scale=scale, causal=causal, window=window, softcap=softcap, deterministic=deterministic(),
        )  # fmt: skip

    def fwd_kwargs(self, q, k, v, pk, causal, window, softcap, scale) -> dict:
        return self.fwd_adapter.kwargs(dict(self.values(pk, causal, window, softcap, scale), q=q, k=k, v=v))

    def bwd_kwargs(self, do, q, k, v, o, lse, dq, dk, dv, pk, causal, window, softcap, scale) -> dict:
        vals = dict(self.values(pk, causal, window, softcap, scale), q=q, k=k, v=v, dq=dq, dk=dk, dv=dv)
        return self.bwd_adapter.kwargs(dict(vals, dout=do, out=o, softmax_lse=lse))

    @staticmethod
    def unpack_forward(res):
        """(out, softmax_lse) from a forward's results: 4 values (2.7+, flash-attn 3: out, lse, ...) or 8
        (2.5/2.6: out, q, k, v, out_padded, lse, S_dmask, rng_state)."""
        return (res[0], res[1]) if len(res) <= 4 else (res[0], res[5])

    def _kfwd(self, q, k, v, pk, causal, window, softcap, scale):
        return self.unpack_forward(self._fwd_fn(**self.fwd_kwargs(q, k, v, pk, causal, window, softcap, scale)))

    def _kbwd(self, do, q, k, v, o, lse, pk, causal, window, softcap, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._bwd_fn(**self.bwd_kwargs(do, q, k, v, o, lse, dq, dk, dv, pk, causal, window, softcap, scale))
        return dq, dk, dv


class FlashAttnBackend(_FlashPackageBackend):
    """flash-attn 2.x package (``_flash_attn_varlen_forward/_backward``)."""

    name = "flash_attn"
    modules = ("flash_attn.flash_attn_interface",)
    fwd_names = ("_flash_attn_varlen_forward",)
    bwd_names = ("_flash_attn_varlen_backward",)
    swaps_gqa = True


class FlashAttn3Backend(_FlashPackageBackend):
    """flash-attn 3 (Hopper): ``_flash_attn_forward/_backward`` with ``cu_seqlens_*`` (or the older
    ``_flash_attn_varlen_forward/_backward``) from ``flash_attn_interface``; needs compute capability 9.0."""

    name = "flash_attn3"
    modules = ("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    fwd_names = ("_flash_attn_forward", "_flash_attn_varlen_forward")
    bwd_names = ("_flash_attn_backward", "_flash_attn_varlen_backward")
    min_capability = (9, 0)
