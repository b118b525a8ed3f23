"""The driver shared by the CUDA varlen kernels (PyTorch's built-in flash kernel, flash-attn 2, flash-attn 3).
Blocks the kernels' window mapping would misread are split first (:func:`split_tall`).

Pieces are grouped by kernel mask: (causal, window_left, window_right) in the kernel's bottom-right-aligned window
convention, computed from each trimmed piece's band; each group is packed as consecutive varlen segments (slices
where the pieces are already consecutive in memory, a gather otherwise) with ``cu_seqlens`` on the device. The
packing is cached on the pieces per device (layouts cache their pieces), so repeated calls copy nothing from the
host. The kernel's ``softmax_lse`` comes back unpadded ``[H, total_q]`` (newer kernels) or padded
``[B, H, max_q]`` (older ones); both are converted to rows ``[total_q, H]``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from attention.backends.base import Backend, Pieces


def ranges_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + l)`` for every (s, l), vectorised."""
    total = int(lens.sum())
    offs = np.cumsum(lens) - lens
    return np.repeat(starts - offs, lens) + np.arange(total, dtype=np.int64)


def kernel_windows(p: Pieces) -> np.ndarray:
    """int64 [n, 3]: (causal, window_left, window_right) per piece for a kernel whose window is aligned at the
    bottom-right corner (query ``i`` sees key ``j`` iff ``-right <= i - j + k_len - q_len <= left``; -1 = unbounded).
    Trimmed pieces give non-negative bounds. A single query row gets ``right = 0`` (exact: after trimming it sees
    every key of its piece), which also keeps flash-attn 2 from its ``max_q == 1`` GQA head swap."""
    shift = p.k_len - p.q_len
    left = np.where(p.hi >= p.q_len - 1, -1, p.hi + shift)
    right = np.where(p.lo <= -(p.k_len - 1), -1, -p.lo - shift)
    right = np.where(p.q_len == 1, 0, right)
    causal = p.causal & (p.q_len > 1)
    left, right = np.where(causal, -1, left), np.where(causal, -1, right)
    return np.stack([causal.astype(np.int64), left, right], axis=1)


def _chunks(ql: int, kl: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) of one trimmed banded piece, each with at most (its keys + 1) rows: the rows that see
    every key, the rows above them (right side cut) and below them (left side cut); rows cut on both sides are
    taken greedily, each range as long as its keys allow."""
    r1, r2 = max(0, kl - 1 + lo), min(ql, hi + 1)  # rows [r1, r2) see every key
    if r1 < r2:
        bounds = sorted({0, r1, r2, ql})
        ranges = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    else:
        ranges = [(0, ql)]
    out = []
    for a, b in ranges:
        while a < b:  # rows [a, a+m) see keys max(0, a-hi) .. ; m <= their key count + 1
            m = min(b - a, kl - max(0, a - hi) + 1)
            out.append((a, a + m))
            a += m
    return out


def split_tall(p: Pieces) -> Pieces:
    """``p`` with every banded piece of more than ``k_len + 1`` query rows split by rows into pieces of at most
    ``k_len + 1`` rows (:func:`_chunks`), the same pairs in total.

    Why: flash-attn 2 (2.5-2.8, ``csrc/flash_attn/flash_api.cpp``), PyTorch's copy of it and the flash-attn 3
    beta map a right window of -1 (or one >= ``max_seqlen_k``) to ``max_seqlen_k`` when the left one is bounded.
    With the mask aligned bottom-right, row ``i`` of a segment then sees keys only up to
    ``i + k_len - q_len + max_seqlen_k``: the first ``q_len - max_seqlen_k - 1`` rows of a taller block lose keys.
    With ``q_len <= k_len + 1 <= max_seqlen_k + 1`` every such bound covers the whole row, so any window value the
    kernels' C++ derives is exact (flash-attn 3 from 2025 on maps -1 to ``max_seqlen_q - 1`` and needs no split)."""
    tall = np.nonzero(p.banded & (p.q_len > p.k_len + 1))[0]
    if tall.shape[0] == 0:
        return p
    parts = [np.stack([p.q_start, p.q_len, p.k_start, p.k_len, p.lo, p.hi], 1)[np.setdiff1d(np.arange(len(p)), tall)]]
    for t in tall:
        qs, ql, ks, kl, lo, hi = (int(a[t]) for a in (p.q_start, p.q_len, p.k_start, p.k_len, p.lo, p.hi))
        rows = [(qs + a, b - a, ks, kl, lo - a, hi - a) for a, b in _chunks(ql, kl, lo, hi)]
        parts.append(np.array(rows, dtype=np.int64).reshape(-1, 6))
    a = np.concatenate(parts)
    a = a[np.argsort(a[:, 0], kind="stable")]
    return Pieces(a[:, 0], a[:, 1], a[:, 2], a[:, 3], False, a[:, 4], a[:, 5], p.softcap)


class Packed:
    """One kernel call's pieces as consecutive varlen segments on ``device``."""

    def __init__(self, p: Pieces, device) -> None:
        self.n = len(p)
        self.q = self._side(p.q_start, p.q_len, device)
        self.k = self._side(p.k_start, p.k_len, device)
        self.cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(p.q_len)]).astype(np.int32)).to(device)
        self.cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(p.k_len)]).astype(np.int32)).to(device)
        self.max_q, self.max_k = int(p.q_len.max()), int(p.k_len.max())
        self.q_len = p.q_len
        self.total_q = int(p.q_len.sum())
        b = np.repeat(np.arange(self.n), self.q_len)
        r = np.arange(self.total_q) - np.repeat(np.cumsum(self.q_len) - self.q_len, self.q_len)
        self.pad_b, self.pad_r = torch.from_numpy(b).to(device), torch.from_numpy(r).to(device)

    @staticmethod
    def _side(starts, lens, device):
        if (starts[1:] == starts[:-1] + lens[:-1]).all():
            return ("slice", int(starts[0]), int(lens.sum()))
        return ("index", torch.from_numpy(ranges_index(starts, lens)).to(device))

    @staticmethod
    def take(side: tuple, x: torch.Tensor) -> torch.Tensor:
        if side[0] == "slice":
            return x[side[1] : side[1] + side[2]]
        return x.index_select(0, side[1])

    @staticmethod
    def put(side: tuple, dst: torch.Tensor, val: torch.Tensor) -> None:
        if side[0] == "slice":
            dst[side[1] : side[1] + side[2]] = val.to(dst.dtype)
        else:
            dst.index_copy_(0, side[1], val.to(dst.dtype))

    @staticmethod
    def add(side: tuple, dst: torch.Tensor, val: torch.Tensor) -> None:
        if side[0] == "slice":
            dst[side[1] : side[1] + side[2]] += val.to(dst.dtype)
        else:
            dst.index_add_(0, side[1], val.to(dst.dtype))

    def lse_from_kernel(self, lse: torch.Tensor, heads: int, kv_heads: int = 0, swapped: bool = False) -> torch.Tensor:
        """Kernel lse -> rows ``[total_q, H]``. ``swapped``: flash-attn 2's ``max_q == 1`` GQA path ran the
        problem as ``[B*groups, Hkv]`` queries and returned its unpadded ``[Hkv, B, groups]`` lse viewed as
        ``[H, B]``; the padded layout of that path is already ``[B, H, 1]`` in head order."""
        if lse.dim() == 2 and lse.shape == (heads, self.total_q):
            if swapped and kv_heads and heads > kv_heads:
                g = heads // kv_heads
                lse = lse.reshape(kv_heads, self.total_q, g).permute(0, 2, 1).reshape(heads, self.total_q)
            return lse.t()
        if lse.dim() == 3 and lse.shape[0] == self.n and lse.shape[1] == heads:
            return lse.permute(0, 2, 1)[self.pad_b, self.pad_r]
        raise RuntimeError(f"unexpected softmax_lse shape {tuple(lse.shape)} from the varlen kernel")

    def lse_to_kernel(self, lse_rows: torch.Tensor, like_padded: bool) -> torch.Tensor:
        """Rows ``[total_q, H]`` -> the kernel's layout (unpadded ``[H, total_q]`` or padded ``[B, H, max_q]``)."""
        if not like_padded:
            return lse_rows.t().contiguous()
        out = torch.zeros(self.n, self.max_q, lse_rows.shape[1], dtype=lse_rows.dtype, device=lse_rows.device)
        out[self.pad_b, self.pad_r] = lse_rows
        return out.permute(0, 2, 1).contiguous()


def cuda_capability_ok(q: torch.Tensor) -> bool:
    """Flash kernels need compute capability 8.0 (Ampere) or newer."""
    return q.is_cuda and torch.cuda.get_device_capability(q.device) >= (8, 0)


def deterministic() -> bool:
    """Deterministic backward kernels exactly when PyTorch is asked for deterministic algorithms."""
    return torch.are_deterministic_algorithms_enabled()


class VarlenCUDABackend(Backend):
    """Common driver: subclasses provide ``_kfwd(q, k, v, packed, causal, window, softcap, scale)`` and
    ``_kbwd(dout, q, k, v, out, lse, packed, causal, window, softcap, scale)``, and the capability flags."""

    has_window = False  # the kernel takes window sizes
    has_softcap = False  # the kernel takes a softcap
    swaps_gqa = False  # flash-attn 2 family: a max_q == 1 GQA call without a window runs head-swapped
    max_head_dim = 256
    _lse_padded: Optional[bool] = None

    def available(self) -> bool:
        return True

    def _kfwd(self, q, k, v, pk: Packed, causal, window, softcap, scale):  # pragma: no cover - interface
        raise NotImplementedError

    def _kbwd(self, do, q, k, v, o, lse, pk: Packed, causal, window, softcap, scale):  # pragma: no cover - interface
        raise NotImplementedError

    def supports(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> bool:
        return not self.why_not(q, k, window, softcap)

    def why_not(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> str:
        if not self.available():
            return f"{self.name} is not available"
        if window and not self.has_window:
            return f"{self.name} (this version) takes no sliding window"
        if softcap and not self.has_softcap:
            return f"{self.name} (this version) takes no softcap"
        if not q.is_cuda:
            return f"{self.name} runs CUDA tensors only"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"{self.name} runs float16/bfloat16 only, got {q.dtype}"
        if q.shape[2] % 8 or q.shape[2] > self.max_head_dim:
            return f"{self.name} needs head_dim a multiple of 8 and <= {self.max_head_dim}, got {q.shape[2]}"
        return self.device_problem(q)

    def device_problem(self, q: torch.Tensor) -> str:
        """Why this kernel cannot run on ``q``'s CUDA device whatever the inputs ("" if it can, or on CPU)."""
        if q.is_cuda and not cuda_capability_ok(q):
            cap = torch.cuda.get_device_capability(q.device)
            return f"{self.name} needs compute capability 8.0+, {q.device} has {cap}"
        return ""

    def _calls(self, pieces: Pieces, device):
        """Kernel calls [(packed, causal, window)] grouped by kernel mask, cached per device. Windowed blocks with
        more query rows than keys + 1 are split first (:func:`split_tall`), so no kernel's window mapping can change
        what a row sees."""

        def build():
            p = split_tall(pieces) if self.has_window else pieces
            wins = kernel_windows(p)
            keys, inv = np.unique(wins, axis=0, return_inverse=True)
            inv = inv.reshape(-1)
            return [(Packed(p.select(inv == g), device), bool(key[0]), (int(key[1]), int(key[2])))
                    for g, key in enumerate(keys)]  # fmt: skip

        if pieces.banded.any() and not self.has_window:
            raise ValueError(f"{self.name} takes no sliding window; choose another backend")
        return pieces.device_cached((type(self).__name__, str(device)), build)

    def _swapped(self, pk: Packed, q, k, window) -> bool:
        return self.swaps_gqa and pk.max_q == 1 and q.shape[1] > k.shape[1] and window == (-1, -1)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Pieces, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self._empty_fwd(q, v)
        for pk, causal, window in self._calls(pieces, q.device):
            qq = Packed.take(pk.q, q).contiguous()
            kk, vv = Packed.take(pk.k, k).contiguous(), Packed.take(pk.k, v).contiguous()
            o, piece_lse = self._kfwd(qq, kk, vv, pk, causal, window, pieces.softcap, scale)
            type(self)._lse_padded = piece_lse.dim() == 3
            Packed.put(pk.q, out, o)
            rows = pk.lse_from_kernel(piece_lse, q.shape[1], k.shape[1], self._swapped(pk, q, k, window))
            Packed.put(pk.q, lse, rows)
        return out, lse

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = self._zero_grads(q, k, v)
        if self._lse_padded is None and len(pieces):  # learn the kernel's lse layout once
            self.forward(q, k, v, pieces.select(np.arange(1)), scale)
        for pk, causal, window in self._calls(pieces, q.device):
            qq = Packed.take(pk.q, q).contiguous()
            kk, vv = Packed.take(pk.k, k).contiguous(), Packed.take(pk.k, v).contiguous()
            do = Packed.take(pk.q, dout).to(q.dtype).contiguous()
            oo = Packed.take(pk.q, out).to(q.dtype).contiguous()
            ll = pk.lse_to_kernel(Packed.take(pk.q, lse).float(), bool(self._lse_padded))
            gq, gk, gv = self._kbwd(do, qq, kk, vv, oo, ll, pk, causal, window, pieces.softcap, scale)
            Packed.put(pk.q, dq, gq)
            Packed.add(pk.k, dk, gk)
            Packed.add(pk.k, dv, gv)
        return dq, dk, dv
