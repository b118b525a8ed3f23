"""flash-attn packages: flash-attn 2.x (``flash_attn.flash_attn_interface``) and flash-attn 3 (the Hopper
interface ``flash_attn_interface``), through their private varlen forward/backward functions.

Those functions drifted across releases: flash-attn 2.5 (``window_size`` tuple, no softcap, 8 results), 2.6
(+ ``softcap``), 2.7 / 2.8 (``window_size_left/right``, 4 results, ``torch.library`` ops); flash-attn 3 beta (2024:
``_flash_attn_varlen_forward/_backward``), flash-attn 3 of 2025 (one ``_flash_attn_forward`` taking
``cu_seqlens_*`` with about 25 parameters without defaults and a ``window_size`` tuple), flash-attn 3 custom ops
(late 2025: defaults everywhere, ``window_size_left/right``, ``out_``, ``is_causal`` in the backward). Arguments are
matched by name from ``inspect.signature`` through an alias table, results by tuple length, never by version string.
A signature is accepted only if every argument that carries meaning (queries, lengths, scale, the causal flag,
deterministic) has a parameter to go to and every parameter without a default gets a value (ours or a neutral one
from :data:`NEUTRAL`): otherwise the backend refuses when it is built, naming the parameter, so ``auto`` moves on
before the first forward.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Optional

import torch

from attention.backends.binding import ArgAdapter, signature_params
from attention.backends.varlen_cuda import VarlenCUDABackend, deterministic

log = logging.getLogger(__name__)

REQUIRED_FWD = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
                "causal")  # fmt: skip
REQUIRED_BWD = REQUIRED_FWD + ("dout", "out", "softmax_lse", "dq", "dk", "dv", "deterministic")

# values that switch off what the project does not use (dropout, ALiBi, paged / appended KV, rotary, FP8 descaling,
# attention chunks, split-KV scheduling, returned probabilities), for parameters without a default
NEUTRAL = dict(
    dropout_p=0.0, return_softmax=False, alibi_slopes=None, block_table=None, leftpad_k=None, seqused_k=None,
    seqused_q=None, zero_tensors=False, rng_state=None, k_new=None, v_new=None, qv=None, out_=None,
    cu_seqlens_k_new=None, page_table=None, kv_batch_idx=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
    q_descale=None, k_descale=None, v_descale=None, attention_chunk=0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0, sink_token_length=0, gen=None,
)  # fmt: skip
NEUTRAL_FWD = dict(NEUTRAL, out=None)  # the forward's ``out`` is a preallocated output buffer (flash-attn 3, 2025)


_OUR_FWD = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
            "deterministic")  # fmt: skip
_OUR_BWD = _OUR_FWD + ("dout", "out", "softmax_lse", "dq", "dk", "dv")


def _missing_module(e: BaseException, mod_name: str) -> bool:
    """The import failed only because ``mod_name`` (or a parent of it) does not exist."""
    name = getattr(e, "name", None)
    return isinstance(e, ModuleNotFoundError) and name is not None and (mod_name == name or
                                                                         mod_name.startswith(name + "."))  # fmt: skip


def _load(modules: tuple[str, ...], fwd_names: tuple[str, ...], bwd_names: tuple[str, ...]) -> tuple[list, list]:
    """(every (module, forward fn, backward fn) found, in preference order; why each installed module failed).

    A module that is not installed is skipped (debug log). One that exists but whose import raises (a broken CUDA
    extension, a torch/ABI mismatch, a missing dependency), or that lacks the functions, is reported in the
    failures; the caller decides whether that is worth a warning (not when another module works)."""
    found, failures = [], []
    for mod_name in modules:
        try:
            installed = importlib.util.find_spec(mod_name.split(".")[0]) is not None
        except (ImportError, ValueError):  # a broken parent package or an odd sys.modules entry
            installed = True
        if not installed:
            log.debug("%s is not installed", mod_name)
            continue
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:  # noqa: BLE001 - any import-time error of an installed kernel package is reported
            if _missing_module(e, mod_name):
                log.debug("%s is not installed (%s)", mod_name, e)
                continue
            failures.append(f"{mod_name} is installed but its import failed: {type(e).__name__}: {e}")
            log.debug("import of %s failed", mod_name, exc_info=e)
            continue
        pairs = [(f, b) for f, b in zip(fwd_names, bwd_names) if hasattr(mod, f) and hasattr(mod, b)]
        if not pairs:
            failures.append(f"{mod_name} is installed but has none of {list(zip(fwd_names, bwd_names))}")
        found += [(f"{mod_name}.{f}", getattr(mod, f), getattr(mod, b)) for f, b in pairs]
    return found, failures


def package_version(dist_names: tuple[str, ...]) -> str:
    """The installed version of the first distribution found, or ""."""
    from importlib import metadata

    for name in dist_names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return ""


class _FlashPackageBackend(VarlenCUDABackend):
    """A flash-attn package bound through :class:`ArgAdapter`s; ``functions`` (forward, backward) may be given
    (tests pass stand-ins with recorded signatures), else they are imported. ``installed`` tells a package that is
    absent from one that is present but rejected (``problem`` says why; logged once as a WARNING)."""

    modules: tuple[str, ...] = ()
    fwd_names: tuple[str, ...] = ()
    bwd_names: tuple[str, ...] = ()
    dists: tuple[str, ...] = ()
    min_capability = (8, 0)

    def __init__(self, functions: Optional[tuple] = None) -> None:
        self.problem = ""
        self._fwd_fn: Optional[Callable] = None
        self._bwd_fn: Optional[Callable] = None
        self.source = ""
        failures: list = []
        if functions is not None:
            candidates = [("given", functions[0], functions[1])]
        else:
            candidates, failures = _load(self.modules, self.fwd_names, self.bwd_names)
        self.installed = bool(candidates or failures)
        self.version = package_version(self.dists) if functions is None else "given"
        if not candidates:
            self.problem = "; ".join(failures) if failures else f"{self.name} is not installed"
            self._warn_rejected()
            return
        rejected = []
        for source, fwd, bwd in candidates:
            self.fwd_adapter = ArgAdapter(signature_params(fwd), REQUIRED_FWD, _OUR_FWD + tuple(NEUTRAL_FWD))
            self.bwd_adapter = ArgAdapter(signature_params(bwd), REQUIRED_BWD, _OUR_BWD + tuple(NEUTRAL))
            bad = self.fwd_adapter.error or self.bwd_adapter.error
            if not bad:
                self.source, self._fwd_fn, self._bwd_fn = source, fwd, bwd
                break
            rejected.append(f"{source}: {bad}")
        if self._fwd_fn is None:
            self.problem = f"{self.name}: unsupported kernel signature ({'; '.join(rejected)})"
            self._warn_rejected()
            return
        self.has_window = self.fwd_adapter.has_window and self.bwd_adapter.has_window
        self.has_softcap = self.fwd_adapter.has_softcap and self.bwd_adapter.has_softcap
        log.debug("%s bound to %s (%s)", self.name, self.source, self.version or "version unknown")

    def _warn_rejected(self) -> None:
        if self.installed:
            log.warning("attention backend %s is installed but unusable: %s", self.name, self.problem)

    def available(self) -> bool:
        return self._fwd_fn is not None

    def why_not(self, q, k, window: bool = False, softcap: bool = False) -> str:
        if self.problem:
            return self.problem
        return super().why_not(q, k, window, softcap)

    def device_problem(self, q) -> str:
        if q.is_cuda and torch.cuda.get_device_capability(q.device) < self.min_capability:
            cap = torch.cuda.get_device_capability(q.device)
            return f"{self.name} needs compute capability {self.min_capability}, {q.device} has {cap}"
        return super().device_problem(q)

    @staticmethod
    def values(pk, causal, window, softcap, scale, neutral) -> dict:
        return dict(
            neutral, cu_seqlens_q=pk.cu_q, cu_seqlens_k=pk.cu_k, max_seqlen_q=pk.max_q, max_seqlen_k=pk.max_k,
            softmax_scale=scale, causal=causal, window=window, softcap=softcap, deterministic=deterministic(),
        )  # fmt: skip

    def fwd_kwargs(self, q, k, v, pk, causal, window, softcap, scale) -> dict:
        vals = self.values(pk, causal, window, softcap, scale, NEUTRAL_FWD)
        return self.fwd_adapter.kwargs(dict(vals, q=q, k=k, v=v))

    def bwd_kwargs(self, do, q, k, v, o, lse, dq, dk, dv, pk, causal, window, softcap, scale) -> dict:
        vals = dict(self.values(pk, causal, window, softcap, scale, NEUTRAL), q=q, k=k, v=v, dq=dq, dk=dk, dv=dv)
        return self.bwd_adapter.kwargs(dict(vals, dout=do, out=o, softmax_lse=lse))

    @staticmethod
    def unpack_forward(res):
        """(out, softmax_lse) from a forward's results: 4 values (2.7+, flash-attn 3: out, lse, ...), 6 (flash-attn
        3 beta: out, q, k, v, out_padded, lse) or 8 (2.5/2.6: out, q, k, v, out_padded, lse, S_dmask, rng_state)."""
        return (res[0], res[1]) if len(res) <= 4 else (res[0], res[5])

    def _kfwd(self, q, k, v, pk, causal, window, softcap, scale):
        assert self._fwd_fn is not None, "kernels run only on a backend whose available() is true"
        return self.unpack_forward(self._fwd_fn(**self.fwd_kwargs(q, k, v, pk, causal, window, softcap, scale)))

    def _kbwd(self, do, q, k, v, o, lse, pk, causal, window, softcap, scale):
        assert self._bwd_fn is not None, "kernels run only on a backend whose available() is true"
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._bwd_fn(**self.bwd_kwargs(do, q, k, v, o, lse, dq, dk, dv, pk, causal, window, softcap, scale))
        return dq, dk, dv


class FlashAttnBackend(_FlashPackageBackend):
    """flash-attn 2.x package (``_flash_attn_varlen_forward/_backward``)."""

    name = "flash_attn"
    modules = ("flash_attn.flash_attn_interface",)
    fwd_names = ("_flash_attn_varlen_forward",)
    bwd_names = ("_flash_attn_varlen_backward",)
    dists = ("flash-attn", "flash_attn")
    swaps_gqa = True


class FlashAttn3Backend(_FlashPackageBackend):
    """flash-attn 3 (Hopper): ``_flash_attn_forward/_backward`` with ``cu_seqlens_*`` (or the 2024 beta's
    ``_flash_attn_varlen_forward/_backward``) from ``flash_attn_interface``; needs compute capability 9.0."""

    name = "flash_attn3"
    modules = ("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    fwd_names = ("_flash_attn_forward", "_flash_attn_varlen_forward")
    bwd_names = ("_flash_attn_backward", "_flash_attn_varlen_backward")
    dists = ("flash_attn_3", "flash-attn-3", "flashattn-hopper")
    min_capability = (9, 0)
