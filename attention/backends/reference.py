"""The reference backend: plain masked softmax per piece, in the accumulation dtype, any dtype and device. It
materialises ``[heads, q_len, k_len]`` scores per piece: meant for tests, CPU masks the fused kernel lacks, and short
pieces."""

from __future__ import annotations

import math

import torch

from attention.backends.base import Backend, Pieces, acc_dtype


def _band_mask(lq: int, lk: int, lo: int, hi: int, device) -> torch.Tensor:
    diff = torch.arange(lq, device=device)[:, None] - torch.arange(lk, device=device)[None, :]
    return (diff >= lo) & (diff <= hi)


class ReferenceBackend(Backend):
    """Plain masked softmax per piece (with band masks and softcap), computed in the accumulation dtype."""

    name = "reference"

    def supports(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> bool:
        return True

    @staticmethod
    def _scores(qp, kp, lo: int, hi: int, scale: float, softcap: float):
        """Scores ``[hk, g, lq, lk]`` after the softcap and the mask, and the tanh of the capped scores (or None)."""
        lq, h, d = qp.shape
        hk = kp.shape[1]
        s = torch.einsum("qhgd,khd->hgqk", qp.reshape(lq, hk, h // hk, d), kp) * scale
        th = None
        if softcap > 0:
            th = torch.tanh(s / softcap)
            s = th * softcap
        if lo > -kp.shape[0] + 1 or hi < lq - 1:
            s = s.masked_fill(~_band_mask(lq, kp.shape[0], lo, hi, qp.device), -math.inf)
        return s, th

    @staticmethod
    def _piece(pieces: Pieces, i: int):
        return tuple(
            int(a[i]) for a in (pieces.q_start, pieces.q_len, pieces.k_start, pieces.k_len, pieces.lo, pieces.hi)
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Pieces, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a = acc_dtype(q.dtype)
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=a, device=q.device)
        lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=a, device=q.device)
        for i in range(len(pieces)):
            qs, ql, ks, kl, lo, hi = self._piece(pieces, i)
            qp, kp, vp = q[qs : qs + ql].to(a), k[ks : ks + kl].to(a), v[ks : ks + kl].to(a)
            s, _ = self._scores(qp, kp, lo, hi, scale, pieces.softcap)  # [hk, g, lq, lk]
            piece_lse = torch.logsumexp(s, dim=-1)
            o = torch.einsum("hgqk,khd->qhgd", torch.exp(s - piece_lse[..., None]), vp)
            out[qs : qs + ql] = o.reshape(ql, q.shape[1], v.shape[2])
            lse[qs : qs + ql] = piece_lse.permute(2, 0, 1).reshape(ql, q.shape[1])
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
        a = acc_dtype(q.dtype)
        dq, dk, dv = self._zero_grads(q, k, v)
        h, hk, d = q.shape[1], k.shape[1], q.shape[2]
        g = h // hk
        for i in range(len(pieces)):
            qs, ql, ks, kl, lo, hi = self._piece(pieces, i)
            qp, kp, vp = q[qs : qs + ql].to(a), k[ks : ks + kl].to(a), v[ks : ks + kl].to(a)
            do = dout[qs : qs + ql].to(a).reshape(ql, hk, g, d)
            op = out[qs : qs + ql].to(a).reshape(ql, hk, g, d)
            piece_lse = lse[qs : qs + ql].to(a).reshape(ql, hk, g).permute(1, 2, 0)
            s, th = self._scores(qp, kp, lo, hi, scale, pieces.softcap)
            p = torch.exp(s - piece_lse[..., None])
            dv[ks : ks + kl] += torch.einsum("hgqk,qhgd->khd", p, do)
            dp = torch.einsum("qhgd,khd->hgqk", do, vp)
            delta = (do * op).sum(-1).permute(1, 2, 0)
            ds = p * (dp - delta[..., None])
            if th is not None:  # d(c*tanh(x/c))/dx = 1 - tanh^2
                ds = ds * (1 - th * th)
            dq[qs : qs + ql] += (torch.einsum("hgqk,khd->qhgd", ds, kp) * scale).reshape(ql, h, d)
            dk[ks : ks + kl] += torch.einsum("hgqk,qhgd->khd", ds, qp.reshape(ql, hk, g, d)) * scale
        return dq, dk, dv
