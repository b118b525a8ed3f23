"""Attention kernels behind one interface, working on *pieces* of packed THD tensors.

A :class:`Pieces` lists attention blocks: block ``i`` lets query rows ``[q_start[i], q_start[i]+q_len[i])`` attend
key rows ``[k_start[i], k_start[i]+k_len[i])`` with a full mask, or, where ``causal[i]``, a causal mask on a square
diagonal block (``q_len == k_len``, the same tokens). Query ranges of the pieces of one call never overlap; rows no
piece covers get ``out = 0`` and ``lse = -inf``.

Every backend has ``forward(q, k, v, pieces, scale) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, pieces, scale) -> (dq, dk, dv)``, with q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]``
(GQA: ``H % Hkv == 0``), lse ``[Tq, H]`` in the accumulation dtype (float64 for float64 inputs, else float32), and
gradients in the accumulation dtype. ``backward`` takes the *final* (merged) ``out``/``lse`` of the rows, so the
gradients of one key block are exact parts of the full gradient (the flash-attention identity
``dS = P * (dP - rowsum(dO * O))`` with ``P = exp(S - lse)``).

Backends: ``reference`` (plain masked softmax, any dtype and device, for tests and as a fallback), ``torch``
(PyTorch's fused kernels: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, one batched
call per group of same-shape pieces; on CUDA the varlen ``aten._flash_attention_forward/backward``), ``flash_attn``
(the flash-attn 2.x package on CUDA, private varlen API detected by signature).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for merges and gradients: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Pieces:
    """Attention blocks of one kernel call (see module docstring). Arrays are int64 numpy, causal is bool."""

    q_start: np.ndarray
    q_len: np.ndarray
    k_start: np.ndarray
    k_len: np.ndarray
    causal: np.ndarray

    def __init__(self, q_start, q_len, k_start, k_len, causal) -> None:
        arrs = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (q_start, q_len, k_start, k_len)]
        n = arrs[0].shape[0]
        if any(a.shape[0] != n for a in arrs):
            raise ValueError("Pieces: arrays must have equal length")
        c = np.broadcast_to(np.asarray(causal, dtype=bool), (n,)).copy()
        for name, a in zip(("q_start", "q_len", "k_start", "k_len"), arrs):
            object.__setattr__(self, name, a)
        object.__setattr__(self, "causal", c)
        if (c & (arrs[1] != arrs[3])).any():
            raise ValueError("Pieces: causal pieces must be square (q_len == k_len)")

    @staticmethod
    def empty() -> Pieces:
        z = np.zeros(0, dtype=np.int64)
        return Pieces(z, z, z, z, False)

    def __len__(self) -> int:
        return int(self.q_len.shape[0])

    def nonempty(self) -> Pieces:
        keep = (self.q_len > 0) & (self.k_len > 0)
        return self if keep.all() else self.select(keep)

    def select(self, sel) -> Pieces:
        return Pieces(self.q_start[sel], self.q_len[sel], self.k_start[sel], self.k_len[sel], self.causal[sel])

    def pairs(self) -> int:
        """(query, key) pairs computed: full pieces q_len*k_len, causal pieces q_len*(q_len+1)/2."""
        full = self.q_len * self.k_len
        return int(np.where(self.causal, self.q_len * (self.q_len + 1) // 2, full).sum())

    def groups(self):
        """Yield ``(q_len, k_len, causal, selector)`` for each group of same-shape pieces."""
        if len(self) == 0:
            return
        key = (self.q_len * (1 << 31) + self.k_len) * 2 + self.causal
        uniq, inv = np.unique(key, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[order], np.arange(uniq.shape[0] + 1))
        for g in range(uniq.shape[0]):
            sel = order[bounds[g] : bounds[g + 1]]
            yield int(self.q_len[sel[0]]), int(self.k_len[sel[0]]), bool(self.causal[sel[0]]), sel


def _row_index(starts: np.ndarray, length: int, device) -> torch.Tensor:
    return torch.from_numpy(starts[:, None] + np.arange(length, dtype=np.int64)[None, :]).to(device)


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
    """Kernel interface. Subclasses implement ``supports``, ``forward`` and ``backward``."""

    name = "base"

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def forward(self, q, k, v, pieces: Pieces, scale: float):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, pieces: Pieces, scale: float):  # pragma: no cover - interface
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


# ---------------------------------------------------------------------------------------------- reference
class ReferenceBackend(Backend):
    """Plain masked softmax per piece, computed in the accumulation dtype. Any dtype, any device."""

    name = "reference"

    def supports(self, q, k) -> bool:
        return True

    @staticmethod
    def _scores(qp, kp, causal, scale):
        lq, h, d = qp.shape
        hk = kp.shape[1]
        s = torch.einsum("qhgd,khd->hgqk", qp.reshape(lq, hk, h // hk, d), kp) * scale
        if causal:
            m = torch.ones(lq, kp.shape[0], dtype=torch.bool, device=qp.device).tril(kp.shape[0] - lq)
            s = s.masked_fill(~m, -math.inf)
        return s

    def forward(self, q, k, v, pieces, scale):
        a = acc_dtype(q.dtype)
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=a, device=q.device)
        lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=a, device=q.device)
        for i in range(len(pieces)):
            qs, ql, ks, kl = (
                int(pieces.q_start[i]),
                int(pieces.q_len[i]),
                int(pieces.k_start[i]),
                int(pieces.k_len[i]),
            )
            qp, kp, vp = q[qs : qs + ql].to(a), k[ks : ks + kl].to(a), v[ks : ks + kl].to(a)
            s = self._scores(qp, kp, bool(pieces.causal[i]), scale)  # [hk, g, lq, lk]
            piece_lse = torch.logsumexp(s, dim=-1)
            o = torch.einsum("hgqk,khd->qhgd", torch.exp(s - piece_lse[..., None]), vp)
            out[qs : qs + ql] = o.reshape(ql, q.shape[1], v.shape[2])
            lse[qs : qs + ql] = piece_lse.permute(2, 0, 1).reshape(ql, q.shape[1])
        return out, lse

    def backward(self, dout, q, k, v, out, lse, pieces, scale):
        a = acc_dtype(q.dtype)
        dq, dk, dv = self._zero_grads(q, k, v)
        h, hk, d = q.shape[1], k.shape[1], q.shape[2]
        g = h // hk
        for i in range(len(pieces)):
            qs, ql, ks, kl = (
                int(pieces.q_start[i]),
                int(pieces.q_len[i]),
                int(pieces.k_start[i]),
                int(pieces.k_len[i]),
            )
            qp, kp, vp = q[qs : qs + ql].to(a), k[ks : ks + kl].to(a), v[ks : ks + kl].to(a)
            do = dout[qs : qs + ql].to(a).reshape(ql, hk, g, d)
            op = out[qs : qs + ql].to(a).reshape(ql, hk, g, d)
            piece_lse = lse[qs : qs + ql].to(a).reshape(ql, hk, g).permute(1, 2, 0)
            p = torch.exp(self._scores(qp, kp, bool(pieces.causal[i]), scale) - piece_lse[..., None])
            dv[ks : ks + kl] += torch.einsum("hgqk,qhgd->khd", p, do)
            dp = torch.einsum("qhgd,khd->hgqk", do, vp)
            delta = (do * op).sum(-1).permute(1, 2, 0)
            ds = p * (dp - delta[..., None])
            dq[qs : qs + ql] += (torch.einsum("hgqk,khd->qhgd", ds, kp) * scale).reshape(ql, h, d)
            dk[ks : ks + kl] += torch.einsum("hgqk,qhgd->khd", ds, qp.reshape(ql, hk, g, d)) * scale
        return dq, dk, dv


# ---------------------------------------------------------------------------------------------- torch (CPU)
class _Batch:
    """Rows of one group of same-shape pieces as [B, H, L, D] views (a slice when B == 1, a gather otherwise)."""

    def __init__(self, pieces: Pieces, sel: np.ndarray, lq: int, lk: int, device) -> None:
        self.single = sel.shape[0] == 1
        if self.single:
            self.qs, self.ks = int(pieces.q_start[sel[0]]), int(pieces.k_start[sel[0]])
            self.lq, self.lk = lq, lk
        else:
            self.qi = _row_index(pieces.q_start[sel], lq, device)  # [B, lq]
            self.ki = _row_index(pieces.k_start[sel], lk, device)

    def rows_q(self, x):  # [T, H, D] -> [B, H, lq, D]
        if self.single:
            return x[self.qs : self.qs + self.lq].unsqueeze(0).transpose(1, 2)
        return x[self.qi].transpose(1, 2)

    def rows_k(self, x):
        if self.single:
            return x[self.ks : self.ks + self.lk].unsqueeze(0).transpose(1, 2)
        return x[self.ki].transpose(1, 2)

    def rows_lse(self, lse):  # [T, H] -> [B, H, lq]
        if self.single:
            return lse[self.qs : self.qs + self.lq].unsqueeze(0).transpose(1, 2)
        return lse[self.qi].transpose(1, 2)

    def put_q(self, dst, val):  # val [B, H, lq, ...] -> dst rows
        val = val.transpose(1, 2)
        if self.single:
            dst[self.qs : self.qs + self.lq] = val[0]
        else:
            dst[self.qi] = val.to(dst.dtype)

    def add_k(self, dst, val):
        val = val.transpose(1, 2).to(dst.dtype)
        if self.single:
            dst[self.ks : self.ks + self.lk] += val[0]
        else:
            dst.index_add_(0, self.ki.reshape(-1), val.reshape((-1,) + tuple(val.shape[2:])))


class TorchCPUBackend(Backend):
    """PyTorch's CPU flash-attention kernel (returns the log-sum-exp), GQA native, float64/32/16/bfloat16."""

    name = "torch"
    _fwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    _bwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def supports(self, q, k) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, pieces, scale):
        out, lse = self._empty_fwd(q, v)
        for lq, lk, causal, sel in pieces.groups():
            b = _Batch(pieces, sel, lq, lk, q.device)
            o, piece_lse = self._fwd(b.rows_q(q), b.rows_k(k), b.rows_k(v), 0.0, causal, scale=scale)
            b.put_q(out, o)
            b.put_q(lse, piece_lse.to(lse.dtype))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, pieces, scale):
        dq, dk, dv = self._zero_grads(q, k, v)
        kern_lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = out.to(q.dtype)
        dout = dout.to(q.dtype)
        lse = lse.to(kern_lse_dtype)
        for lq, lk, causal, sel in pieces.groups():
            b = _Batch(pieces, sel, lq, lk, q.device)
            gq, gk, gv = self._bwd(
                b.rows_q(dout),
                b.rows_q(q),
                b.rows_k(k),
                b.rows_k(v),
                b.rows_q(out),
                b.rows_lse(lse),
                0.0,
                causal,
                scale=scale,
            )
            b.put_q(dq, gq)
            b.add_k(dk, gk)
            b.add_k(dv, gv)
        return dq, dk, dv


# ---------------------------------------------------------------------------------------------- CUDA varlen kernels
def _ranges_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    total = int(lens.sum())
    offs = np.cumsum(lens) - lens
    return np.repeat(starts - offs, lens) + np.arange(total, dtype=np.int64)


class _Packed:
    """Pieces (of one causal flag) as consecutive varlen segments: slices where the pieces are already consecutive
    in memory, a gather otherwise; ``cu_q``/``cu_k`` int32 on the device."""

    def __init__(self, p: Pieces, device) -> None:
        self.n = len(p)
        self.q = self._side(p.q_start, p.q_len, device)
        self.k = self._side(p.k_start, p.k_len, device)
        self.cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(p.q_len)]).astype(np.int32)).to(device)
        self.cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(p.k_len)]).astype(np.int32)).to(device)
        self.max_q, self.max_k = int(p.q_len.max()), int(p.k_len.max())
        self.q_len = p.q_len
        self.total_q = int(p.q_len.sum())

    @staticmethod
    def _side(starts, lens, device):
        if (starts[1:] == starts[:-1] + lens[:-1]).all():
            return ("slice", int(starts[0]), int(lens.sum()))
        return ("index", torch.from_numpy(_ranges_index(starts, lens)).to(device))

    @staticmethod
    def take(side, x):
        if side[0] == "slice":
            return x[side[1] : side[1] + side[2]]
        return x.index_select(0, side[1])

    @staticmethod
    def put(side, dst, val):
        if side[0] == "slice":
            dst[side[1] : side[1] + side[2]] = val.to(dst.dtype)
        else:
            dst.index_copy_(0, side[1], val.to(dst.dtype))

    @staticmethod
    def add(side, dst, val):
        if side[0] == "slice":
            dst[side[1] : side[1] + side[2]] += val.to(dst.dtype)
        else:
            dst.index_add_(0, side[1], val.to(dst.dtype))

    # kernel lse layouts: unpadded [H, total_q] (newer kernels) or padded [B, H, max_q] (older ones)
    def lse_from_kernel(self, lse: torch.Tensor, heads: int) -> torch.Tensor:
        if lse.dim() == 2 and lse.shape == (heads, self.total_q):
            return lse.t()
        if lse.dim() == 3 and lse.shape[0] == self.n and lse.shape[1] == heads:
            b, r = self._padded_index(lse.device)
            return lse.permute(0, 2, 1)[b, r]
        raise RuntimeError(f"unexpected softmax_lse shape {tuple(lse.shape)} from the varlen kernel")

    def lse_to_kernel(self, lse_rows: torch.Tensor, like_padded: bool) -> torch.Tensor:
        if not like_padded:
            return lse_rows.t().contiguous()
        b, r = self._padded_index(lse_rows.device)
        out = torch.zeros(self.n, self.max_q, lse_rows.shape[1], dtype=lse_rows.dtype, device=lse_rows.device)
        out[b, r] = lse_rows
        return out.permute(0, 2, 1).contiguous()

    def _padded_index(self, device):
        b = np.repeat(np.arange(self.n), self.q_len)
        r = np.arange(self.total_q) - np.repeat(np.cumsum(self.q_len) - self.q_len, self.q_len)
        return torch.from_numpy(b).to(device), torch.from_numpy(r).to(device)


class _VarlenCUDABackend(Backend):
    """Common driver for varlen CUDA kernels: subclasses provide ``_kfwd`` and ``_kbwd``."""

    _lse_padded: Optional[bool] = None

    def supports(self, q, k) -> bool:
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] % 8 == 0 and q.shape[2] <= 256

    def _split(self, pieces):
        for flag in (False, True):
            sel = pieces.causal == flag
            if sel.any():
                yield flag, pieces.select(sel)

    def forward(self, q, k, v, pieces, scale):
        out, lse = self._empty_fwd(q, v)
        for causal, p in self._split(pieces):
            pk = _Packed(p, q.device)
            qq = _Packed.take(pk.q, q).contiguous()
            kk, vv = _Packed.take(pk.k, k).contiguous(), _Packed.take(pk.k, v).contiguous()
            o, piece_lse = self._kfwd(qq, kk, vv, pk, causal, scale)
            type(self)._lse_padded = piece_lse.dim() == 3
            _Packed.put(pk.q, out, o)
            _Packed.put(pk.q, lse, pk.lse_from_kernel(piece_lse, q.shape[1]))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, pieces, scale):
        dq, dk, dv = self._zero_grads(q, k, v)
        if self._lse_padded is None and len(pieces):  # learn the kernel's lse layout once
            p0 = pieces.select(np.arange(1))
            self.forward(q, k, v, p0, scale)
        for causal, p in self._split(pieces):
            pk = _Packed(p, q.device)
            qq = _Packed.take(pk.q, q).contiguous()
            kk, vv = _Packed.take(pk.k, k).contiguous(), _Packed.take(pk.k, v).contiguous()
            do = _Packed.take(pk.q, dout).to(q.dtype).contiguous()
            oo = _Packed.take(pk.q, out).to(q.dtype).contiguous()
            ll = pk.lse_to_kernel(_Packed.take(pk.q, lse).float(), bool(self._lse_padded))
            gq, gk, gv = self._kbwd(do, qq, kk, vv, oo, ll, pk, causal, scale)
            _Packed.put(pk.q, dq, gq)
            _Packed.add(pk.k, dk, gk)
            _Packed.add(pk.k, dv, gv)
        return dq, dk, dv


class TorchCUDABackend(_VarlenCUDABackend):
    """PyTorch's built-in flash-attention 2 varlen kernel (``aten._flash_attention_forward/backward``)."""

    name = "torch"

    def _kfwd(self, q, k, v, pk, causal, scale):
        res = torch.ops.aten._flash_attention_forward(
            q, k, v, pk.cu_q, pk.cu_k, pk.max_q, pk.max_k, 0.0, causal, False, scale=scale
        )
        return res[0], res[1]

    def _kbwd(self, do, q, k, v, o, lse, pk, causal, scale):
        # dropout_p == 0: the philox seed/offset are not read; pass empty placeholders of the expected dtype
        seed = torch.zeros(2, dtype=torch.int64, device=q.device)
        off = torch.zeros((), dtype=torch.int64, device=q.device)
        res = torch.ops.aten._flash_attention_backward(
            do, q, k, v, o, lse, pk.cu_q, pk.cu_k, pk.max_q, pk.max_k, 0.0, causal, seed, off, scale=scale
        )
        return res[0], res[1], res[2]


def _signature_params(fn) -> dict:
    for cand in (getattr(fn, "_init_fn", None), fn):  # torch.library custom ops keep the Python function
        if cand is None:
            continue
        try:
            params = inspect.signature(cand).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
            return dict(params)
    return {}


def _fill_kwargs(params: dict, values: dict) -> Optional[dict]:
    """Keyword arguments for a function with ``params`` from ``values``; None if a required one is unknown."""
    kw = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in values:
            kw[name] = values[name]
        elif p.default is inspect.Parameter.empty:
            return None
    return kw


class FlashAttnBackend(_VarlenCUDABackend):
    """flash-attn 2.x package. Its private ``_flash_attn_varlen_forward/_backward`` drifted across 2.x (window_size
    vs window_size_left/right, softcap, alibi_slopes, block_table, return tuples of 8 or 4 values); arguments are
    matched by name from ``inspect.signature`` and results by tuple length, never by version string."""

    name = "flash_attn"

    def __init__(self) -> None:
        self._fwd_fn = self._bwd_fn = None
        self._fwd_params = self._bwd_params = {}
        try:
            from flash_attn import flash_attn_interface as fai  # noqa: PLC0415
        except Exception:  # ImportError, or a broken CUDA extension
            return
        fwd, bwd = getattr(fai, "_flash_attn_varlen_forward", None), getattr(fai, "_flash_attn_varlen_backward", None)
        if fwd is None or bwd is None:
            return
        self._fwd_params, self._bwd_params = _signature_params(fwd), _signature_params(bwd)
        if self._fwd_params and self._bwd_params:
            self._fwd_fn, self._bwd_fn = fwd, bwd

    @property
    def available(self) -> bool:
        return self._fwd_fn is not None

    def supports(self, q, k) -> bool:
        return self.available and super().supports(q, k)

    @staticmethod
    def _common(pk, causal, scale) -> dict:
        return dict(
            cu_seqlens_q=pk.cu_q,
            cu_seqlens_k=pk.cu_k,
            max_seqlen_q=pk.max_q,
            max_seqlen_k=pk.max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size=(-1, -1),
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
            block_table=None,
            leftpad_k=None,
            seqused_k=None,
            zero_tensors=False,
            deterministic=False,
            rng_state=None,
        )

    def _kfwd(self, q, k, v, pk, causal, scale):
        kw = _fill_kwargs(self._fwd_params, dict(q=q, k=k, v=v, **self._common(pk, causal, scale)))
        if kw is None:
            raise RuntimeError(f"flash_attn: unsupported _flash_attn_varlen_forward signature {list(self._fwd_params)}")
        res = self._fwd_fn(**kw)
        # 2.6+: (out, softmax_lse, S_dmask, rng_state); older: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng)
        return (res[0], res[1]) if len(res) <= 4 else (res[0], res[5])

    def _kbwd(self, do, q, k, v, o, lse, pk, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = _fill_kwargs(
            self._bwd_params,
            dict(
                dout=do, q=q, k=k, v=v, out=o, softmax_lse=lse, dq=dq, dk=dk, dv=dv, **self._common(pk, causal, scale)
            ),
        )
        if kw is None:
            raise RuntimeError(
                f"flash_attn: unsupported _flash_attn_varlen_backward signature {list(self._bwd_params)}"
            )
        self._bwd_fn(**kw)
        return dq, dk, dv


# ---------------------------------------------------------------------------------------------- selection
_REFERENCE = ReferenceBackend()
_TORCH_CPU = TorchCPUBackend()
_TORCH_CUDA = TorchCUDABackend()
_FLASH: Optional[FlashAttnBackend] = None

BACKENDS = ("auto", "flash_attn", "torch", "reference")


def _flash() -> FlashAttnBackend:
    global _FLASH
    if _FLASH is None:
        _FLASH = FlashAttnBackend()
    return _FLASH


def get_backend(name: str, q: torch.Tensor, k: torch.Tensor) -> Backend:
    """The backend ``name`` for these tensors; ``"auto"``: flash_attn, else torch, else reference, whichever
    applies first. Raises ValueError for an unknown name or a backend that cannot run these tensors."""
    if isinstance(name, Backend):
        return name
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    torch_b = _TORCH_CUDA if q.is_cuda else _TORCH_CPU
    if name == "auto":
        for b in (_flash(), torch_b):
            if b.supports(q, k):
                return b
        return _REFERENCE
    b = {"flash_attn": _flash(), "torch": torch_b, "reference": _REFERENCE}[name]
    if not b.supports(q, k):
        raise ValueError(
            f"backend {name!r} cannot run {q.dtype} tensors on {q.device}"
            + ("" if name != "flash_attn" or _flash().available else " (flash_attn is not installed)")
        )
    return b
