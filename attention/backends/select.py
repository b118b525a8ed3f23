"""Backend selection: ``get_backend(name, q, k, ...)``, with the automatic choice logged once per cause.

``"auto"`` takes the first of flash-attn 3, flash-attn 2, PyTorch's fused kernel whose ``supports`` holds (device,
dtype, head_dim, compute capability, how PyTorch was built, masks asked for), and the reference backend otherwise;
the log line of the choice names every preferred
kernel that refused and why. A kernel package that is installed but unusable (its import fails, it lacks the
functions, its signature cannot be filled) is one WARNING line when it is first built, one that is usable but cannot
run on this device (compute capability, a PyTorch built without flash kernels) one WARNING line when it first
refuses; "not installed" is only a DEBUG line.
On CUDA the reference backend materialises ``[heads, L, L]`` scores per document: it is taken only for documents up
to :data:`REFERENCE_CUDA_MAX_LEN` tokens; longer ones raise a ValueError naming why every fused kernel refused.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from attention.backends.base import Backend
from attention.backends.flash import FlashAttn3Backend, FlashAttnBackend
from attention.backends.reference import ReferenceBackend
from attention.backends.torch_cpu import TorchCPUBackend
from attention.backends.torch_cuda import TorchCUDABackend

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flash_attn3", "flash_attn", "torch", "reference")
REFERENCE_CUDA_MAX_LEN = 4096  # [H, L, L] fp32 scores: 64 MiB per head at this length

_REFERENCE = ReferenceBackend()
_TORCH_CPU = TorchCPUBackend()
_LAZY: dict = {}
_LOGGED: set = set()
_WARNED_BACKENDS: set = set()


def _backend(name: str, cuda: bool) -> Backend:
    if name == "reference":
        return _REFERENCE
    if name == "torch" and not cuda:
        return _TORCH_CPU
    if name not in _LAZY:  # CUDA and package backends are built on first use (imports, schema reads)
        _LAZY[name] = {"torch": TorchCUDABackend, "flash_attn": FlashAttnBackend, "flash_attn3": FlashAttn3Backend}[
            name
        ]()
    return _LAZY[name]


def log_once(level: int, msg: str) -> None:
    """Log ``msg`` the first time it occurs in this process (decisions are logged per cause, not per call)."""
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.log(level, msg)


def candidates(cuda: bool) -> tuple[str, ...]:
    """The fused kernels ``auto`` tries, in preference order."""
    return ("flash_attn3", "flash_attn", "torch") if cuda else ("torch",)


def choose(
    q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False
) -> tuple[Optional[Backend], list[tuple[str, str]]]:
    """(the first fused backend that runs these tensors and masks, or None; [(name, why it refused)] for the
    preferred ones before it). A backend that is installed but refuses is logged once as a WARNING."""
    refused: list = []
    for cand in candidates(q.is_cuda):
        b = _backend(cand, q.is_cuda)
        if b.supports(q, k, window, softcap):
            return b, refused
        why = b.why_not(q, k, window, softcap)
        refused.append((cand, why))
        device_problem = getattr(b, "device_problem", None)
        if device_problem is not None and device_problem(q) and cand not in _WARNED_BACKENDS:
            _WARNED_BACKENDS.add(cand)  # detection problems were logged when the backend was built
            log.warning("attention backend %s is installed but cannot run on %s: %s", cand, q.device, why)
    return None, refused


def get_backend(
    name: str | Backend,
    q: torch.Tensor,
    k: torch.Tensor,
    window: bool = False,
    softcap: bool = False,
    max_len: Optional[int] = None,
) -> Backend:
    """The backend ``name`` (one of :data:`BACKENDS`, or a :class:`Backend` instance) for these tensors and masks
    (``window``: a sliding window is asked for; ``softcap``: a softcap). ``max_len``: the longest document, which
    decides whether the reference backend may run on CUDA. Raises ValueError, naming the reason, for an unknown name
    or a backend that cannot run these tensors."""
    if isinstance(name, Backend):
        return name
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name != "auto":
        b = _backend(name, q.is_cuda)
        reason = b.why_not(q, k, window, softcap) if not b.supports(q, k, window, softcap) else ""
        if reason:
            raise ValueError(f"backend {name!r} cannot run here: {reason}")
        return b
    chosen, refused = choose(q, k, window, softcap)
    notes = [f"{n}: {why}" for n, why in refused]
    if chosen is not None:
        why = f" (not {'; not '.join(notes)})" if notes else ""  # the preferred kernels and why they refused
        log_once(logging.INFO, f"attention backend: {chosen.name} for {q.dtype} on {q.device.type}"
                 + _masks(window, softcap) + why)  # fmt: skip
        return chosen
    why = "; ".join(notes)
    if q.is_cuda and max_len is not None and max_len > REFERENCE_CUDA_MAX_LEN:
        raise ValueError(
            f"no fused attention kernel runs these inputs ({why}), and the reference backend would materialise "
            f"[heads, {max_len}, {max_len}] scores per document on the GPU; use float16/bfloat16, head_dim a "
            "multiple of 8 up to 256, or a kernel that supports the masks asked for"
        )
    level = logging.WARNING if q.is_cuda else logging.INFO
    log_once(level, f"attention backend: reference (plain masked softmax) for {q.dtype} on {q.device.type}"
             + _masks(window, softcap) + f" because {why}")  # fmt: skip
    return _REFERENCE


def _masks(window: bool, softcap: bool) -> str:
    parts = [m for m, on in (("sliding window", window), ("softcap", softcap)) if on]
    return f" with {' and '.join(parts)}" if parts else ""
