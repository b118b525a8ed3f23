"""The plain masked-softmax attention every attention test compares against."""

from __future__ import annotations

import math

import numpy as np
import torch


def reference(q, k, v, cu, causal, scale, window_size=(-1, -1), softcap=0.0):
    """Plain masked softmax over the whole packed batch, in the inputs' dtype (GQA by repeating KV heads).
    ``window_size=(left, right)``: a query at position p sees keys at p-left .. p+right (-1 = unbounded, flash-attn
    semantics); ``softcap``: scores s -> softcap * tanh(s / softcap)."""
    lens = np.diff(cu)
    doc = torch.from_numpy(np.repeat(np.arange(len(lens)), lens))
    pos = torch.arange(q.shape[0]) - torch.from_numpy(np.repeat(cu[:-1], lens))
    mask = doc[:, None] == doc[None, :]
    diff = pos[:, None] - pos[None, :]  # query position - key position
    if causal:
        mask &= diff >= 0
    left, right = window_size
    if left >= 0:
        mask &= diff <= left
    if right >= 0:
        mask &= diff >= -right
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(g, 1))
