"""`cp_attention`: exact attention of this rank's queries over packed documents split across a CP group, by one of
three methods (ring, all-gather, Ulysses), after one agreement check of every rank's inputs."""

from __future__ import annotations

import math
import struct
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from attention._dist import Group, consensus_check, dtype_code
from attention.allgather import AllGatherAttention
from attention.backends import check_inputs, get_backend
from attention.layout import CPLayout
from attention.masks import Mask, make_mask
from attention.ring import RingAttention
from attention.ulysses import ulysses_attention

METHODS = ("ring", "allgather", "ulysses")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _validate(q_local, k_local, v_local, layout: CPLayout, g: Group, method, head_chunks, backend, mask: Mask):
    """The backend for this call; ValueError for bad inputs (raised on every rank by the consensus check)."""
    check_inputs(q_local, k_local, v_local)
    want = layout.num_local_tokens(g.rank)
    if q_local.shape[0] != want or k_local.shape[0] != want:
        raise ValueError(
            f"rank {g.rank} holds {want} tokens in this layout, got q {q_local.shape[0]}, k/v {k_local.shape[0]} rows"
        )
    if not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
    if method == "ulysses" and q_local.shape[1] % g.size:
        raise ValueError(
            f"method='ulysses' splits heads over the CP group: {q_local.shape[1]} query heads are not divisible by "
            f"{g.size} ranks; use method='ring' or 'allgather'"
        )
    lens = np.diff(layout.cu_seqlens)
    longest = int(lens.max()) if lens.size else 0
    return get_backend(backend, q_local, k_local, mask.windowed, mask.softcap > 0, longest)


def cp_attention(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    layout: CPLayout,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    method: str = "ring",
    backend: str = "auto",
    rank: Optional[int] = None,
    head_chunks: int = 1,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """Exact attention of this rank's queries over packed documents split across the CP ``group``.

    ``q_local`` ``[T_local, H, D]``, ``k_local``/``v_local`` ``[T_local, Hkv, D]``: this rank's tokens in
    ``layout.shard`` order (``T_local = layout.num_local_tokens(rank)``). Every rank of ``group`` (default: WORLD)
    must call with the same layout, heads, head_dim, dtype, masks, method and scale. ``method``: ``"ring"`` (P2P KV
    rotation), ``"allgather"`` (gather KV, ``head_chunks`` groups of KV heads at a time) or ``"ulysses"``
    (all-to-all to a head split; ``H`` divisible by the group size). ``window_size=(left, right)``: flash-attn
    sliding window (-1 = unbounded); ``softcap``: tanh soft-capping of the scaled scores (0 = off). Differentiable in
    q, k, v. Returns ``[T_local, H, D]``. Raises ValueError on every rank if any rank's inputs are inconsistent (the
    agreement is checked once per layout and arguments; later identical calls exchange nothing).
    """
    if not isinstance(layout, CPLayout):
        raise TypeError(f"layout must be a CPLayout, got {type(layout).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    mask = make_mask(causal, window_size, softcap)
    g = Group.of(group, q_local.device)
    if layout.cp_size != g.size:
        raise ValueError(f"layout.cp_size is {layout.cp_size} but the process group has {g.size} ranks")
    if rank is not None and rank != g.rank:
        raise ValueError(f"rank={rank} but this process is rank {g.rank} of the group")
    err = None
    try:
        be = _validate(q_local, k_local, v_local, layout, g, method, head_chunks, backend, mask)
    except ValueError as e:
        err = str(e)
    shape = (list(q_local.shape[1:]) + list(k_local.shape[1:]) + [0] * 6)[:6]  # fixed length for the exchange
    d = q_local.shape[-1] if q_local.dim() else 1
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(max(d, 1))
    masks = [int(mask.causal), *mask.window, _float_bits(mask.softcap)]
    values = [
        layout.fingerprint(),
        *shape,
        dtype_code(q_local.dtype),
        *masks,
        METHODS.index(method),
        _float_bits(scale),
    ]
    consensus_check(g, values, err, layout._cache.setdefault("verified", set()))
    if method == "ring":
        return RingAttention.apply(q_local, k_local, v_local, layout, g, mask, scale, be)
    if method == "ulysses":
        return ulysses_attention(q_local, k_local, v_local, layout, g, mask, scale, be)
    return AllGatherAttention.apply(q_local, k_local, v_local, layout, g, mask, scale, be, head_chunks)
