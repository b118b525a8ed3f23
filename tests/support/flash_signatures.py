"""Stand-ins for the flash-attn varlen kernels with the exact Python signatures of flash-attn 2.5.0, 2.6.3, 2.7.4,
2.8.3 and flash-attn 3 (Hopper interface), computing on CPU in float64 with the kernels' conventions: cu_seqlens
segments, a causal/window mask aligned at the bottom-right corner (-1 = unbounded), softcap on the scaled scores,
the lse returned unpadded ``[H, total_q]`` or padded ``[B, H, max_q]``, flash-attn 2's ``max_q == 1`` GQA head swap
of the unpadded lse, and the backward writing into ``dq, dk, dv``. Each call is recorded in ``CALLS``."""

from __future__ import annotations

import math
from typing import Optional

import torch

CALLS: list = []
STATE = {"padded": False}  # lse layout the stand-ins return


def _segment_mask(sq, sk, causal, left, right):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    d = i - j + (sk - sq)
    if causal:
        right = 0
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        ok &= d >= -right
    if left >= 0:
        ok &= d <= left
    return ok


def _attend(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap):
    """(out [Tq, H, D] float64, lse [H, Tq] float64), differentiable. Window sizes >= max_seqlen_k count as
    unbounded, as in the kernels."""
    h, hk = q.shape[1], k.shape[1]
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    left, right = (-1 if w >= max_k else w for w in (left, right))
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qq, kk, vv = (x.double() for x in (q[qs:qe], k[ks:ke].repeat_interleave(h // hk, 1), v[ks:ke]))
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~_segment_mask(qe - qs, ke - ks, causal, left, right), -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, vv.repeat_interleave(h // hk, 1)))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def _grads(dout, q, k, v, o, lse, cu_q, cu_k, scale, causal, left, right, softcap):
    """Analytic gradients (custom ops run their body with autograd off): dS = P * (dP - rowsum(dO * O))."""
    h, hk = q.shape[1], k.shape[1]
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    left, right = (-1 if w >= max_k else w for w in (left, right))
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
    for b in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qq = q[qs:qe].double()
        kk, vv = (x[ks:ke].double().repeat_interleave(h // hk, 1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        th = torch.tanh(s / softcap) if softcap > 0 else None
        if th is not None:
            s = softcap * th
        s = s.masked_fill(~_segment_mask(qe - qs, ke - ks, causal, left, right), -math.inf)
        p = torch.exp(s - lse[:, qs:qe, None])
        do = dout[qs:qe]
        dvr = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * o[qs:qe]).sum(-1).t()[..., None])
        if th is not None:
            ds = ds * (1 - th * th)
        dq[qs:qe] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dkr = torch.einsum("hqk,qhd->khd", ds, qq) * scale
        dk[ks:ke] = dkr.reshape(ke - ks, hk, h // hk, -1).sum(2)
        dv[ks:ke] = dvr.reshape(ke - ks, hk, h // hk, -1).sum(2)
    return dq, dk, dv


def _swapped(q, k, max_q, left, right):
    return max_q == 1 and q.shape[1] > k.shape[1] and left < 0 and right < 0


def _lse_out(lse, cu_q, max_q, swapped, kv_heads):
    h, total = lse.shape
    if STATE["padded"]:
        out = torch.full((cu_q.shape[0] - 1, h, max_q), math.inf, dtype=torch.float32)
        for b in range(cu_q.shape[0] - 1):
            out[b, :, : int(cu_q[b + 1] - cu_q[b])] = lse[:, int(cu_q[b]) : int(cu_q[b + 1])]
        return out
    lse = lse.float()
    if swapped:  # the kernel computed [Hkv, B, groups] and returns it viewed as [H, B]
        g = h // kv_heads
        lse = lse.reshape(kv_heads, g, total).permute(0, 2, 1).reshape(h, total)
    return lse.contiguous()


def _fwd(q, k, v, cu_q, cu_k, max_q, scale, causal, left, right, softcap, version):
    CALLS.append(dict(version=version, kind="fwd", causal=causal, window=(left, right), softcap=softcap))
    if max_q == 1:
        causal = False  # as the kernels do: one query row, causal = full
    swapped = _swapped(q, k, max_q, left, right) and not causal
    out, lse = _attend(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap)
    return out.to(q.dtype), _lse_out(lse.detach(), cu_q, max_q, swapped, k.shape[1])


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal, left, right, softcap, det, version):
    CALLS.append(dict(version=version, kind="bwd", causal=causal, window=(left, right), deterministic=det))
    o, ref_lse = _attend(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap)
    g = _grads(dout.double(), q, k, v, o, ref_lse, cu_q, cu_k, scale, causal, left, right, softcap)
    for dst, src in zip((dq, dk, dv), g):
        dst.copy_(src)
    return torch.empty(0)


# ------------------------------------------------------------------ flash-attn 2.5.0
def fwd_2_5_0(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              window_size, alibi_slopes, return_softmax, block_table):  # fmt: skip
    out, lse = _fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, *window_size, 0.0, "2.5.0"
    )
    return out, q, k, v, out, lse, None, None


def bwd_2_5_0(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                *window_size, 0.0, deterministic, "2.5.0")  # fmt: skip


# ------------------------------------------------------------------ flash-attn 2.6.3
def fwd_2_6_3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              window_size, softcap, alibi_slopes, return_softmax, block_table, leftpad_k=None, seqused_k=None):  # fmt: skip  # noqa: E501
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, *window_size, softcap,
                    "2.6.3")  # fmt: skip
    return out, q, k, v, out, lse, None, None


def bwd_2_6_3(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              rng_state=None):  # fmt: skip
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                *window_size, softcap, deterministic, "2.6.3")  # fmt: skip


# ------------------------------------------------------------------ flash-attn 2.7.4 (plain functions)
def fwd_2_7_4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
              softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
              block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
              seqused_k: Optional[torch.Tensor] = None):  # fmt: skip
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, window_size_left,
                    window_size_right, softcap, "2.7.4")  # fmt: skip
    return out, lse, torch.empty(0), torch.empty(2)


def bwd_2_7_4(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
              dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
              max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
              window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
              rng_state: Optional[torch.Tensor] = None):  # fmt: skip
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                window_size_left, window_size_right, softcap, deterministic, "2.7.4")  # fmt: skip


# ------------------------------------------------------------------ flash-attn 2.8.3 (torch.library custom ops)
@torch.library.custom_op("seqbal_test::fa283_fwd", mutates_args=(), device_types="cpu")
def fwd_2_8_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
              softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
              block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
              seqused_k: Optional[torch.Tensor] = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, window_size_left,
                    window_size_right, softcap, "2.8.3")  # fmt: skip
    return out, lse, torch.empty(0), torch.empty(2)


@torch.library.custom_op("seqbal_test::fa283_bwd", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def bwd_2_8_3(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
              dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
              max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
              window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
              rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                window_size_left, window_size_right, softcap, deterministic, "2.8.3")  # fmt: skip


# ------------------------------------------------------------------ flash-attn 3 (hopper/flash_attn_interface.py)
def fwd_fa3(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
            cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
            page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
            seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
            window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True,
            scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):  # fmt: skip
    assert not STATE["padded"]
    out, lse = _fwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        2,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        "fa3",
    )  # fmt: skip  (flash-attn 3 never swaps heads)
    return out, lse, torch.empty(0), torch.empty(0)


def bwd_fa3(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None,
            max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
            window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):  # fmt: skip
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, is_causal,
                window_size_left, window_size_right, softcap, deterministic, "fa3")  # fmt: skip


VERSIONS = {
    "2.5.0": (fwd_2_5_0, bwd_2_5_0),
    "2.6.3": (fwd_2_6_3, bwd_2_6_3),
    "2.7.4": (fwd_2_7_4, bwd_2_7_4),
    "2.8.3": (fwd_2_8_3, bwd_2_8_3),
    "fa3": (fwd_fa3, bwd_fa3),
}
