"""The plain masked-softmax attention every attention test compares against."""

from __future__ import annotations

import math

import numpy as np
import torch


def reference(q, k, v, cu, causal, scale):
    """Plain masked softmax over the whole packed batch, in the inputs' dtype (GQA by repeating KV heads)."""
    lens = np.diff(cu)
    doc = torch.from_numpy(np.repeat(np.arange(len(lens)), lens))
    pos = torch.arange(q.shape[0]) - torch.from_numpy(np.repeat(cu[:-1], lens))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(g, 1))
