"""Stand-ins for the flash kernels' Python entry points, one per signature generation, with the exact parameter
lists of the releases named (read from Dao-AILab/flash-attention at those tags and from this PyTorch's op schemas),
computing on CPU through the C++ rules of :mod:`support.flash_kernels` (window mapping, causal, GQA swap, empty
rows), in float64. Results come back as the releases return them: result tuple lengths, lse unpadded
``[H, total_q]`` or padded ``[B, H, max_q]``, the backward writing into ``dq, dk, dv``. Every call is recorded in
``CALLS`` (with the rows the kernel's window mapping changed against the band asked for).

``VERSIONS``: name -> (forward, backward, kernel family) for the flash-attn packages; ``TORCH_OPS``: name ->
(forward op, backward op) with PyTorch's ``_flash_attention_forward/backward`` schemas.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from support.flash_kernels import FA2, FA3, FA3_2024, attend, changed_rows, grads, rules

CALLS: list = []
STATE = {"padded": False}  # lse layout the FA2-family / PyTorch stand-ins return (FA3 is always unpadded)


def _lse_out(lse, cu_q, max_q, swapped, kv_heads, padded):
    h, total = lse.shape
    if padded:
        out = torch.full((cu_q.shape[0] - 1, h, max_q), math.inf, dtype=torch.float32)
        for b in range(cu_q.shape[0] - 1):
            out[b, :, : int(cu_q[b + 1] - cu_q[b])] = lse[:, int(cu_q[b]) : int(cu_q[b + 1])]
        return out
    lse = lse.float()
    if swapped:  # the kernel computed [Hkv, B, groups] and returns it viewed as [H, B]
        g = h // kv_heads
        lse = lse.reshape(kv_heads, g, total).permute(0, 2, 1).reshape(h, total)
    return lse.contiguous()


def _fwd(family, version, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap=0.0):
    r = rules(family, "fwd", int(max_q), int(max_k), bool(causal), left, right, q.shape[1], k.shape[1])
    CALLS.append(dict(version=version, kind="fwd", causal=bool(causal), window=(int(left), int(right)),
                      softcap=float(softcap), max_q=int(max_q), max_k=int(max_k), rules=r,
                      changed_rows=changed_rows(cu_q, cu_k, r, bool(causal), int(left), int(right))))  # fmt: skip
    out, lse = attend(q, k, v, cu_q, cu_k, float(scale), r, float(softcap), -math.inf if family == FA3 else math.inf)
    padded = STATE["padded"] and family == FA2
    return out.to(q.dtype), _lse_out(lse, cu_q, int(max_q), r.swapped, k.shape[1], padded)


def _unpad_lse(lse, cu_q):
    if lse.dim() == 2:
        return lse
    rows = [lse[b, :, : int(cu_q[b + 1] - cu_q[b])] for b in range(cu_q.shape[0] - 1)]
    return torch.cat(rows, 1)


def _bwd(family, version, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, left,
         right, softcap, det):  # fmt: skip
    r = rules(family, "bwd", int(max_q), int(max_k), bool(causal), left, right, q.shape[1], k.shape[1])
    CALLS.append(dict(version=version, kind="bwd", causal=bool(causal), window=(int(left), int(right)),
                      deterministic=bool(det), max_q=int(max_q), max_k=int(max_k), rules=r))  # fmt: skip
    g = grads(dout, q, k, v, out, _unpad_lse(lse, cu_q), cu_q, cu_k, float(scale), r, float(softcap))
    for dst, src in zip((dq, dk, dv), g):
        dst.copy_(src)


# ------------------------------------------------------------------ flash-attn 2.5.0 (window_size tuple, 8 results)
def fwd_2_5_0(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              window_size, alibi_slopes, return_softmax):  # fmt: skip
    out, lse = _fwd(FA2, "2.5.0", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, *window_size)  # fmt: skip
    return out, q, k, v, out, lse, None, None


def bwd_2_5_0(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
    _bwd(FA2, "2.5.0", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale, causal, *window_size, 0.0, deterministic)  # fmt: skip
    return dq, dk, dv, None


# ------------------------------------------------------------------ flash-attn 2.5.9 (+ block_table)
def fwd_2_5_9(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              window_size, alibi_slopes, return_softmax, block_table):  # fmt: skip
    out, lse = _fwd(FA2, "2.5.9", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, *window_size)  # fmt: skip
    return out, q, k, v, out, lse, None, None


def bwd_2_5_9(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
    _bwd(FA2, "2.5.9", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale, causal, *window_size, 0.0, deterministic)  # fmt: skip
    return dq, dk, dv, None


# ------------------------------------------------------------------ flash-attn 2.6.3 (+ softcap)
def fwd_2_6_3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
              leftpad_k=None, seqused_k=None):  # fmt: skip
    out, lse = _fwd(FA2, "2.6.3", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, *window_size, softcap)  # fmt: skip
    return out, q, k, v, out, lse, None, None


def bwd_2_6_3(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              rng_state=None):  # fmt: skip
    _bwd(FA2, "2.6.3", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale, causal, *window_size, softcap, deterministic)  # fmt: skip
    return dq, dk, dv, None


# ------------------------------------------------------------------ flash-attn 2.7.4 (plain functions: torch < 2.4)
def fwd_2_7_4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
              softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
              block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
              seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False):  # fmt: skip
    out, lse = _fwd(FA2, "2.7.4", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, window_size_left, window_size_right, softcap)  # fmt: skip
    return out, lse, torch.empty(0), torch.empty(2)


def bwd_2_7_4(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
              dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
              max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
              window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
              rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False):  # fmt: skip
    _bwd(FA2, "2.7.4", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale, causal, window_size_left, window_size_right, softcap, deterministic)  # fmt: skip
    return torch.empty(0)


# ------------------------------------------------------------------ flash-attn 2.8.3 (torch.library custom ops)
@torch.library.custom_op("seqbal_test::fa283_fwd", mutates_args=(), device_types="cpu")
def fwd_2_8_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
              softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
              block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
              seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    out, lse = _fwd(FA2, "2.8.3", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, window_size_left, window_size_right, softcap)  # fmt: skip
    return out, lse, torch.empty(0), torch.empty(2)


@torch.library.custom_op("seqbal_test::fa283_bwd", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def bwd_2_8_3(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
              dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
              max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
              window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
              rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> torch.Tensor:  # fmt: skip
    _bwd(FA2, "2.8.3", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale, causal, window_size_left, window_size_right, softcap, deterministic)  # fmt: skip
    return torch.empty(0)


# ------------------------------------------------------------------ flash-attn 3 beta (hopper, v2.7.0 - v2.7.2)
def fwd_fa3_2024(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 block_table=None, window_size=(-1, -1), seqused_q=None, seqused_k=None):  # fmt: skip
    out, lse = _fwd(FA3_2024, "fa3-2024", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, *window_size)  # fmt: skip
    return out, q, k, v, out, lse


def bwd_fa3_2024(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, causal, window_size, deterministic=False, seqused_q=None,
                 seqused_k=None):  # fmt: skip
    _bwd(FA3_2024, "fa3-2024", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
         max_seqlen_q, max_seqlen_k, softmax_scale, causal, *window_size, 0.0, deterministic)  # fmt: skip
    return dq, dk, dv, None


# ------------------------------------------------------------------ flash-attn 3 before the custom ops (v2.8.3 hopper)
def fwd_fa3_2025(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
                 max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                 seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1),
                 attention_chunk=0, softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                 pack_gqa=None, sm_margin=0):  # fmt: skip
    unused = (k_new, v_new, qv, out, cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k,
              rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, scheduler_metadata)  # fmt: skip
    assert all(x is None for x in unused) and attention_chunk == 0 and num_splits == 1
    o, lse = _fwd(FA3, "fa3-2025", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                  causal, *window_size, softcap)  # fmt: skip
    return o, lse, None, None


def bwd_fa3_2025(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                 max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                 deterministic=False, sm_margin=0):  # fmt: skip
    _bwd(FA3, "fa3-2025", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale, causal, *window_size, softcap, deterministic)  # fmt: skip
    return dq, dk, dv, torch.empty(0)


# ------------------------------------------------------------------ flash-attn 3 custom ops (hopper, after Nov 2025)
def fwd_fa3_op(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
               cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
               page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
               seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
               window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True,
               scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):  # fmt: skip
    assert out_ is None and k_new is None and attention_chunk == 0 and num_splits == 1
    o, lse = _fwd(FA3, "fa3-op", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                  causal, window_size_left, window_size_right, softcap)  # fmt: skip
    return o, lse, torch.empty(0), torch.empty(0)


def bwd_fa3_op(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None,
               max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
               window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):  # fmt: skip
    _bwd(FA3, "fa3-op", dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
         deterministic)  # fmt: skip
    return torch.empty(0)


VERSIONS = {
    "2.5.0": (fwd_2_5_0, bwd_2_5_0, FA2),
    "2.5.9": (fwd_2_5_9, bwd_2_5_9, FA2),
    "2.6.3": (fwd_2_6_3, bwd_2_6_3, FA2),
    "2.7.4": (fwd_2_7_4, bwd_2_7_4, FA2),
    "2.8.3": (fwd_2_8_3, bwd_2_8_3, FA2),
    "fa3-2024": (fwd_fa3_2024, bwd_fa3_2024, FA3_2024),
    "fa3-2025": (fwd_fa3_2025, bwd_fa3_2025, FA3),
    "fa3-op": (fwd_fa3_op, bwd_fa3_op, FA3),
}
FA3_VERSIONS = ("fa3-2024", "fa3-2025", "fa3-op")


# ------------------------------------------------------------------ PyTorch's flash ops (aten schemas)
def _torch_fwd(version, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, left, right):
    left, right = (-1 if w is None else w for w in (left, right))
    out, lse = _fwd(FA2, version, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal, left,
                    right)  # fmt: skip
    return out, lse, torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64), torch.empty(0)


def _torch_bwd(version, grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
               left, right):  # fmt: skip
    left, right = (-1 if w is None else w for w in (left, right))
    dq, dk, dv = (torch.empty(x.shape, dtype=torch.float64) for x in (query, key, value))
    _bwd(FA2, version, grad_out, query, key, value, out, lse, dq, dk, dv, cum_seq_q, cum_seq_k, max_q, max_k, scale,
         is_causal, left, right, 0.0, False)  # fmt: skip
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


_LIB = torch.library.Library("seqbal_test", "FRAGMENT")
_RET_FWD = "(Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)"
_HEAD_FWD = ("(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, SymInt max_q, "
             "SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask")  # fmt: skip
_HEAD_BWD = ("(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
             "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
             "bool is_causal")  # fmt: skip
# torch 2.13.0: torch.ops.aten._flash_attention_forward/backward.default._schema, verbatim
_SCHEMAS = {
    "t213_fwd": _HEAD_FWD + ", *, float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None, "
    "Tensor? seqused_k=None, Tensor? alibi_slopes=None, Tensor? block_table=None, int? num_splits=None) -> " + _RET_FWD,
    "t213_bwd": _HEAD_BWD + ", Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None, "
    "SymInt? window_size_right=None) -> (Tensor, Tensor, Tensor)",
    # without window arguments, the philox arguments spelled philox_seed/philox_offset (older releases)
    "tnw_fwd": _HEAD_FWD + ", *, float? scale=None) -> " + _RET_FWD,
    "tnw_bwd": _HEAD_BWD + ", Tensor philox_seed, Tensor philox_offset, *, float? scale=None) -> (Tensor, Tensor, "
    "Tensor)",
    # an argument without default the project cannot fill: the binding must refuse it when it is built
    "tbad_fwd": _HEAD_FWD + ", float sink_scale, *, float? scale=None) -> " + _RET_FWD,
}


def _t_fwd(version):
    def fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *rest,
            scale=None, window_size_left=None, window_size_right=None, **unused):  # fmt: skip
        assert not rest, "a refused binding must never be called"
        return _torch_fwd(version, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                          window_size_left, window_size_right)  # fmt: skip

    return fwd


def _t_bwd(version):
    def bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            seed, offset, scale=None, window_size_left=None, window_size_right=None):  # fmt: skip
        return _torch_bwd(version, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                          is_causal, scale, window_size_left, window_size_right)  # fmt: skip

    return bwd


for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)
    _version = {"t213": "torch-2.13", "tnw_": "torch-nowindow", "tbad": "torch-unfillable"}[_name[:4]]
    _LIB.impl(_name, (_t_fwd if _name.endswith("fwd") else _t_bwd)(_version), "CPU")

_OPS = torch.ops.seqbal_test
TORCH_OPS = {
    "torch-2.13": (_OPS.t213_fwd, _OPS.t213_bwd),
    "torch-nowindow": (_OPS.tnw_fwd, _OPS.tnw_bwd),
    "torch-unfillable": (_OPS.tbad_fwd, _OPS.t213_bwd),
}
