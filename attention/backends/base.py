"""The kernel interface: :class:`Pieces` (the attention blocks of one kernel call, with their masks) and
:class:`Backend`.

A piece lets query rows ``[q_start, q_start+q_len)`` attend key rows ``[k_start, k_start+k_len)`` where the local
offset ``i - j`` (query row ``i``, key row ``j``, both counted from the piece's start) lies in ``[lo, hi]``:
a full block has ``lo = -(k_len-1)``, ``hi = q_len-1``; a causal diagonal block (the same tokens as queries and
keys) ``lo = 0``; a sliding window narrows the band. Pieces are stored trimmed: every query row sees at least one
key and every key row is seen, so a kernel that aligns its mask bottom-right (flash-attn) gets non-negative window
sizes. ``softcap`` (shared by the pieces of a call) caps the scaled scores ``s`` to ``softcap * tanh(s / softcap)``.
Query ranges of one call never overlap; rows no piece covers get ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

UNBOUNDED = 1 << 62  # |lo| or hi at least this large: no bound on that side


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for merges and gradients: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _i64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.int64).reshape(-1)


@dataclass(frozen=True, eq=False)
class Pieces:
    """Attention blocks of one kernel call (see module docstring). Arrays are int64 numpy; ``causal`` (bool) marks
    the square blocks whose mask is exactly the plain causal one (``lo == 0``, unbounded above)."""

    q_start: np.ndarray
    q_len: np.ndarray
    k_start: np.ndarray
    k_len: np.ndarray
    causal: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    softcap: float
    _device_cache: dict = field(init=False, repr=False, compare=False)

    def __init__(self, q_start, q_len, k_start, k_len, causal=False, lo=None, hi=None, softcap: float = 0.0) -> None:
        qs, ql, ks, kl = (_i64(a) for a in (q_start, q_len, k_start, k_len))
        n = qs.shape[0]
        if any(a.shape[0] != n for a in (ql, ks, kl)):
            raise ValueError("Pieces: arrays must have equal length")
        c = np.broadcast_to(np.asarray(causal, dtype=bool), (n,))
        if (c & (ql != kl)).any():
            raise ValueError("Pieces: causal pieces must be square (q_len == k_len)")
        lo = np.where(c, 0, -UNBOUNDED) if lo is None else np.maximum(np.broadcast_to(_i64(lo), (n,)), -UNBOUNDED)
        hi = np.full(n, UNBOUNDED, dtype=np.int64) if hi is None else np.broadcast_to(_i64(hi), (n,))
        qs, ql, ks, kl, lo, hi = _trim(qs, ql, ks, kl, lo.astype(np.int64), np.minimum(hi, UNBOUNDED))
        for name, a in zip(("q_start", "q_len", "k_start", "k_len", "lo", "hi"), (qs, ql, ks, kl, lo, hi)):
            object.__setattr__(self, name, a)
        object.__setattr__(self, "causal", (ql == kl) & (lo == 0) & (hi == ql - 1))
        object.__setattr__(self, "softcap", float(softcap))
        object.__setattr__(self, "_device_cache", {})

    @staticmethod
    def empty() -> Pieces:
        z = np.zeros(0, dtype=np.int64)
        return Pieces(z, z, z, z, False)

    def __len__(self) -> int:
        return int(self.q_len.shape[0])

    def nonempty(self) -> Pieces:
        """Trimmed pieces are never empty; kept for callers that ask."""
        return self

    def select(self, sel: np.ndarray) -> Pieces:
        return Pieces(
            self.q_start[sel], self.q_len[sel], self.k_start[sel], self.k_len[sel], False,
            self.lo[sel], self.hi[sel], self.softcap,
        )  # fmt: skip

    @property
    def full(self) -> np.ndarray:
        """bool per piece: no mask inside the block."""
        return (self.lo == -(self.k_len - 1)) & (self.hi == self.q_len - 1)

    @property
    def banded(self) -> np.ndarray:
        """bool per piece: a mask that is neither full nor plain causal (needs a window-capable kernel)."""
        return ~(self.full | self.causal)

    def pairs(self) -> int:
        """(query, key) pairs inside the masks: per query row ``i``, keys ``max(0, i-hi) .. min(k_len-1, i-lo)``."""
        total = 0
        for ql, kl, lo, hi in zip(self.q_len, self.k_len, self.lo, self.hi):
            i = np.arange(ql)
            total += int((np.minimum(kl - 1, i - lo) - np.maximum(0, i - hi) + 1).clip(0).sum())
        return total

    def groups(self) -> Iterator[tuple[int, int, bool, np.ndarray]]:
        """Yield ``(q_len, k_len, causal, selector)`` for each group of same-shape full or causal pieces."""
        if len(self) == 0:
            return
        if self.banded.any():
            raise ValueError("Pieces.groups: banded pieces have no (q_len, k_len, causal) kernel shape")
        key = (self.q_len * (1 << 31) + self.k_len) * 2 + self.causal
        uniq, inv = np.unique(key, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[order], np.arange(uniq.shape[0] + 1))
        for g in range(uniq.shape[0]):
            sel = order[bounds[g] : bounds[g + 1]]
            yield int(self.q_len[sel[0]]), int(self.k_len[sel[0]]), bool(self.causal[sel[0]]), sel

    def device_cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` (e.g. index tensors per device): pieces of a layout are cached by the
        layout, so their device-side tensors are made once, not copied host-to-device on every call."""
        cache = self._device_cache
        if key not in cache:
            cache[key] = build()
        return cache[key]


def _trim(qs, ql, ks, kl, lo, hi):
    """Cut query rows that see no key and key rows no query sees; drop pieces left empty. Row ``i`` sees keys
    ``[i-hi, i-lo]``, so rows ``[max(0, lo), min(ql-1, kl-1+hi)]`` and keys ``[max(0, -hi), min(kl-1, ql-1-lo)]``
    survive; offsets shift by the rows and keys cut in front."""
    lo = np.maximum(lo, -(kl - 1))
    hi = np.minimum(hi, ql - 1)
    q0, q1 = np.maximum(0, lo), np.minimum(ql - 1, kl - 1 + hi)
    k0, k1 = np.maximum(0, -hi), np.minimum(kl - 1, ql - 1 - lo)
    keep = (ql > 0) & (kl > 0) & (lo <= hi) & (q1 >= q0) & (k1 >= k0)
    q0, q1, k0, k1 = q0[keep], q1[keep], k0[keep], k1[keep]
    shift = q0 - k0
    return qs[keep] + q0, q1 - q0 + 1, ks[keep] + k0, k1 - k0 + 1, lo[keep] - shift, hi[keep] - shift


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]`` agree (dtype, device, heads, head dim)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"head_dim differs: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"num heads {q.shape[1]} is not a multiple of num kv heads {k.shape[1]}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")


class Backend:
    """Kernel interface: ``forward(q, k, v, pieces, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, pieces, scale) -> (dq, dk, dv)``, q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]``
    (GQA: ``H % Hkv == 0``), lse ``[Tq, H]`` and gradients in the accumulation dtype. ``backward`` takes the final
    (merged) ``out``/``lse`` of the rows, so each key block's gradients are exact parts of the full gradient."""

    name = "base"

    def supports(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> bool:
        """Whether this backend runs these tensors (and sliding-window / softcap masks, when asked)."""
        raise NotImplementedError  # pragma: no cover - interface

    def why_not(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> str:
        """One line saying why :meth:`supports` is False (for error messages and the selection log)."""
        return f"{self.name} cannot run {q.dtype} tensors on {q.device}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Pieces, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        pieces: Pieces,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def _empty_fwd(self, q, v):
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=acc_dtype(q.dtype), device=q.device)
        return out, lse

    @staticmethod
    def _zero_grads(q, k, v):
        a = acc_dtype(q.dtype)
        return (
            torch.zeros(q.shape, dtype=a, device=q.device),
            torch.zeros(k.shape, dtype=a, device=k.device),
            torch.zeros(v.shape, dtype=a, device=v.device),
        )
