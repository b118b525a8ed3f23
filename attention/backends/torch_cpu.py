"""PyTorch's CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward):
one batched call per group of same-shape pieces. The kernel knows full and causal masks only; banded pieces (sliding
windows) go to the reference backend piece by piece, and a softcap sends the whole call there. Either routing is
logged once per process as a WARNING (``attention.backends.torch_cpu``): never a silent fallback."""

from __future__ import annotations

import logging

import numpy as np
import torch

from attention.backends.base import Backend, Pieces
from attention.backends.reference import ReferenceBackend

_REFERENCE = ReferenceBackend()
_ROUTED: set = set()
log = logging.getLogger(__name__)


_WHAT = {"window": ("sliding-window blocks", "sliding window"), "softcap": ("soft-capped calls", "softcap")}


def _routed(cause: str) -> None:
    """Log once per cause that blocks go to the reference kernel instead of the fused one."""
    if cause not in _ROUTED:
        _ROUTED.add(cause)
        what, mask = _WHAT[cause]
        log.warning(
            "torch (CPU) attention: %s run on the reference kernel (plain masked softmax, [heads, q, k] scores per "
            "block) because PyTorch's CPU flash kernel has no %s",
            what,
            mask,
        )


def _row_index(starts: np.ndarray, length: int, device) -> torch.Tensor:
    return torch.from_numpy(starts[:, None] + np.arange(length, dtype=np.int64)[None, :]).to(device)


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

    def supports(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)

    @staticmethod
    def _split(pieces: Pieces):
        """(pieces for the fused kernel, pieces for the reference): banded or soft-capped ones go to the reference."""
        if pieces.softcap > 0:
            _routed("softcap")
            return Pieces.empty(), pieces
        band = pieces.banded
        if not band.any():
            return pieces, Pieces.empty()
        _routed("window")
        return pieces.select(~band), pieces.select(band)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Pieces, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused, plain = self._split(pieces)
        out, lse = self._empty_fwd(q, v) if not len(plain) else _REFERENCE.forward(q, k, v, plain, scale)
        for lq, lk, causal, sel in fused.groups():
            b = _Batch(fused, sel, lq, lk, q.device)
            o, piece_lse = self._fwd(b.rows_q(q), b.rows_k(k), b.rows_k(v), 0.0, causal, scale=scale)
            b.put_q(out, o)
            b.put_q(lse, piece_lse.to(lse.dtype))
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
        fused, plain = self._split(pieces)
        if len(plain):
            dq, dk, dv = _REFERENCE.backward(dout, q, k, v, out, lse, plain, scale)
        else:
            dq, dk, dv = self._zero_grads(q, k, v)
        if not len(fused):
            return dq, dk, dv
        kern_lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, dout, lse = out.to(q.dtype), dout.to(q.dtype), lse.to(kern_lse_dtype)
        for lq, lk, causal, sel in fused.groups():
            b = _Batch(fused, sel, lq, lk, q.device)
            rows = (b.rows_q(dout), b.rows_q(q), b.rows_k(k), b.rows_k(v), b.rows_q(out), b.rows_lse(lse))
            gq, gk, gv = self._bwd(*rows, 0.0, causal, scale=scale)
            b.put_q(dq, gq)
            b.add_k(dk, gk)
            b.add_k(dv, gv)
        return dq, dk, dv
