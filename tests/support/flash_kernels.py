"""CPU models of the flash kernels' C++ argument handling and masks, so that the project's kernel calls can be
checked on CPU against what the GPU kernels would compute (not against what they are meant to compute).

Each *family* is the window/causal/GQA preprocessing of one C++ entry point, read from the kernels' source:

- ``FA2``: flash-attn 2 ``csrc/flash_attn/flash_api.cpp`` ``mha_varlen_fwd`` / ``mha_varlen_bwd`` and
  ``set_params_fprop`` (identical in v2.5.0, v2.5.9, v2.6.3, v2.7.4, v2.8.3), and PyTorch's copy of it
  (``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``, the same lines):
  forward: ``max_seqlen_q == 1`` turns causal off; causal sets ``right = 0``; the GQA head swap when
  ``max_seqlen_q == 1``, ``H > Hkv`` and no window; ``left/right >= max_seqlen_k`` become -1; then
  ``set_params_fprop(seqlen_k = max_seqlen_k)``: ``left < 0 <= right`` -> ``left = max_seqlen_k``,
  ``right < 0 <= left`` -> ``right = max_seqlen_k`` (the rule that widens nothing but cuts rows of a block with more
  than ``max_seqlen_k + 1`` queries). The backward applies the same mapping (no ``max_seqlen_q == 1`` rule).
- ``FA3_2024``: flash-attn 3 beta ``hopper/flash_api.cpp`` (v2.7.0 - v2.7.2): ``left/right = min(max_seqlen_k, w)``,
  ``-1 -> max_seqlen_k``; causal iff ``left == max_seqlen_k and right == 0``.
- ``FA3``: flash-attn 3 ``hopper/flash_api.cpp`` (v2.7.4 - v2.8.3 and the custom-op interface after them):
  ``left >= max_seqlen_k - 1`` and ``right >= max_seqlen_q - 1`` become -1; ``max_seqlen_q == 1`` without a window
  turns causal off; causal sets ``right = 0``; then ``-1 -> max_seqlen_k - 1`` (left) and ``max_seqlen_q - 1``
  (right), which never cuts a row.

The mask of every family (``csrc/flash_attn/src/mask.h`` ``apply_mask_local``, ``hopper/mask.h``) is aligned at the
bottom-right corner of each varlen segment with its *actual* lengths ``sq, sk``: row ``i`` sees columns
``[i + sk - sq - left, i + sk - sq + right]``; causal is ``left = inf, right = 0``; neither causal nor local = full.
A row that sees no key gets ``out = 0`` and ``lse = +inf`` (FA2, ``softmax.h``) or ``-inf`` (FA3).
Everything is computed in float64 whatever the input dtype (the rules, not the rounding, are modelled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FA2, FA3_2024, FA3 = "fa2", "fa3_2024", "fa3"


@dataclass(frozen=True)
class Rules:
    """What the kernel computes after its C++ preprocessing: causal / local masks with these bounds."""

    causal: bool
    local: bool
    left: int
    right: int
    swapped: bool = False


def rules(family: str, kind: str, max_q: int, max_k: int, causal: bool, left: int, right: int, heads: int,
          kv_heads: int) -> Rules:  # fmt: skip
    """The mask the kernel applies for these arguments (see the module docstring for the sources)."""
    left, right = int(left), int(right)
    if family == FA2:
        if kind == "fwd" and max_q == 1:
            causal = False
        if causal:
            right = 0
        swapped = kind == "fwd" and max_q == 1 and heads > kv_heads and left < 0 and right < 0
        left = -1 if left >= max_k else left
        right = -1 if right >= max_k else right
        is_causal = left < 0 and right == 0
        if left < 0 <= right:
            left = max_k
        if right < 0 <= left:
            right = max_k
        return Rules(is_causal, (left >= 0 or right >= 0) and not is_causal, left, right, swapped)
    if family == FA3_2024:
        if causal:
            right = 0
        left, right = min(max_k, left), min(max_k, right)
        left = max_k if left < 0 else left
        right = max_k if right < 0 else right
        is_causal = left == max_k and right == 0
        return Rules(is_causal, (left < max_k or right < max_k) and not is_causal, left, right)
    if family == FA3:
        left = -1 if left >= max_k - 1 else left
        right = -1 if right >= max_q - 1 else right
        if max_q == 1 and left == -1 and right == -1:
            causal = False
        if causal:
            right = 0
        is_causal = left < 0 and right == 0
        is_local = (left >= 0 or right >= 0) and not is_causal
        left = max_k - 1 if left < 0 else left
        right = max_q - 1 if right < 0 else right
        return Rules(is_causal, is_local, left, right)
    raise ValueError(family)


def segment_mask(sq: int, sk: int, r: Rules) -> torch.Tensor:
    """bool [sq, sk]: which keys each query row of one varlen segment sees (bottom-right aligned)."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    shift = sk - sq
    if r.causal:
        return j <= i + shift
    if r.local:
        return (j >= i + shift - r.left) & (j <= i + shift + r.right)
    return torch.ones(sq, sk, dtype=torch.bool)


def _segments(cu_q, cu_k):
    for b in range(cu_q.shape[0] - 1):
        yield int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])


def _scores(qq, kk, scale, softcap, mask):
    s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
    th = None
    if softcap > 0:
        th = torch.tanh(s / softcap)
        s = softcap * th
    return s.masked_fill(~mask, -math.inf), th


def attend(q, k, v, cu_q, cu_k, scale, r: Rules, softcap: float, empty_lse: float):
    """(out [Tq, H, D] float64, lse [H, Tq] float64) as the kernel computes them."""
    h, hk = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], h, v.shape[2], dtype=torch.float64)
    lse = torch.full((h, q.shape[0]), empty_lse, dtype=torch.float64)
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        if qe == qs or ke == ks:
            continue
        qq = q[qs:qe].double()
        kk, vv = (x[ks:ke].double().repeat_interleave(h // hk, 1) for x in (k, v))
        s, _ = _scores(qq, kk, scale, softcap, segment_mask(qe - qs, ke - ks, r))
        m = torch.logsumexp(s, -1)
        seen = torch.isfinite(m)
        p = torch.exp(s - torch.where(seen, m, 0.0)[..., None])
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, vv)
        lse[:, qs:qe] = torch.where(seen, m, torch.tensor(empty_lse, dtype=torch.float64))
    return out, lse


def grads(dout, q, k, v, o, lse, cu_q, cu_k, scale, r: Rules, softcap: float):
    """(dq, dk, dv) float64 as the kernel's backward computes them from the given out/lse (rows with a non-finite
    lse contribute nothing, as the kernels' ``-inf``/``+inf`` lse makes every probability 0)."""
    h, hk = q.shape[1], k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        if qe == qs or ke == ks:
            continue
        qq = q[qs:qe].double()
        kk, vv = (x[ks:ke].double().repeat_interleave(h // hk, 1) for x in (k, v))
        s, th = _scores(qq, kk, scale, softcap, segment_mask(qe - qs, ke - ks, r))
        ll = lse[:, qs:qe].double()
        p = torch.exp(s - torch.where(torch.isfinite(ll), ll, math.inf)[..., None])
        do = dout[qs:qe].double()
        dvr = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * o[qs:qe].double()).sum(-1).t()[..., None])
        if th is not None:
            ds = ds * (1 - th * th)
        dq[qs:qe] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dkr = torch.einsum("hqk,qhd->khd", ds, qq) * scale
        dk[ks:ke] += dkr.reshape(ke - ks, hk, h // hk, -1).sum(2)
        dv[ks:ke] += dvr.reshape(ke - ks, hk, h // hk, -1).sum(2)
    return dq, dk, dv


def changed_rows(cu_q, cu_k, r: Rules, causal: bool, left: int, right: int) -> int:
    """Query rows of a call whose keys under the kernel's mask ``r`` differ from the band the caller asked for
    (bottom-right aligned, -1 = unbounded, causal = right 0): rows the kernel's C++ preprocessing misreads."""
    bad = 0
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        sq, sk = qe - qs, ke - ks
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        want = torch.ones(sq, sk, dtype=torch.bool)
        if causal or right >= 0:
            want &= j <= i + sk - sq + (0 if causal else right)
        if left >= 0:
            want &= j >= i + sk - sq - left
        bad += int((segment_mask(sq, sk, r) != want).any(1).sum())
    return bad
