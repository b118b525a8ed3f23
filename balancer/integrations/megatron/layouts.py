"""The three CP layouts of a Megatron micro-batch, as padded rows and `attention.CPLayout`s.

- ``"zigzag"``: Megatron's default with Transformer Engine: every document padded to a multiple of ``2 * cp`` (when
  ``cp > 1``) and cut into ``2 * cp`` equal chunks, rank ``r`` holding chunks ``r`` and ``2cp-1-r`` (TE's
  ``thd_get_partitioned_indices``). With padded lengths divisible by ``2 * cp`` the project's zigzag layout is
  exactly this partition.
- ``"sequence"``: Megatron's per-sequence balancing (``use_per_sequence_balancing``, and its hybrid-CP path): the
  packed row, padded at its end to a multiple of ``2 * cp``, cut into ``2 * cp`` equal chunks as a whole. The pad
  tokens extend the last document. Expressed as a `CPLayout` whose chunk bounds are the row's chunks seen from
  each document (so the project's CP attention serves it); it records ``{"row_chunks": True}`` in its options,
  which :meth:`CPLayout.from_spec` refuses rather than rebuilding a different layout.
- ``"hybrid"``: the project's layout (short documents whole on one rank, long ones zigzag): no padding at all.

Pad tokens are counted (``padded_lengths`` minus the real lengths), never silent.
"""

from __future__ import annotations

import numpy as np

from attention.geometry import chunk_bounds, chunk_owner
from attention.layout import CPLayout

LAYOUTS = ("zigzag", "sequence", "hybrid")


def check_layout(layout: str | dict) -> dict:
    """The layout as a spec dict ``{"kind": ...}`` (a hybrid spec may carry the hybrid options of
    `CPLayout.build`); ValueError naming ``layout`` otherwise."""
    spec = dict(layout) if isinstance(layout, dict) else {"kind": layout}
    if spec.get("kind") not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (or a hybrid layout spec dict), got {layout!r}")
    if spec["kind"] != "hybrid" and len(spec) > 1:
        raise ValueError(f"layout {spec['kind']!r} takes no options, got {sorted(set(spec) - {'kind'})}")
    return spec


def padded_lengths(lengths: np.ndarray, cp_size: int, kind: str) -> np.ndarray:
    """int64 [n_docs]: each document's length with the layout's padding (zigzag: every document to a multiple of
    ``2 * cp``; sequence: the last document takes the row's padding to a multiple of ``2 * cp``; hybrid and
    ``cp_size == 1``: none)."""
    lens = np.asarray(lengths, dtype=np.int64).copy()
    if cp_size == 1 or kind == "hybrid" or lens.size == 0:
        return lens
    unit = 2 * cp_size
    if kind == "zigzag":
        return -(-lens // unit) * unit
    lens[-1] += -int(lens.sum()) % unit
    return lens


def row_chunk_layout(cu_seqlens: np.ndarray, cp_size: int) -> CPLayout:
    """The ``"sequence"`` layout of a packed row of ``cu_seqlens[-1]`` tokens (a multiple of ``2 * cp_size``): the
    row cut into ``2 * cp_size`` equal chunks, chunk ``j`` on rank ``min(j, 2cp-1-j)``, each document holding the
    part of every chunk that falls inside it. The zigzag ordering facts the CP attention relies on (key chunk ``s <
    r`` precedes both query chunks of rank ``r``; chunks of ``s > r`` lie between them) hold for any monotone chunk
    bounds, so this is served exactly by `attention.cp_attention`."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total, nch = int(cu[-1]), 2 * cp_size
    if total % nch:
        raise ValueError(f"a per-sequence zigzag row must hold a multiple of 2*cp = {nch} tokens, got {total}")
    edges = np.arange(nch + 1, dtype=np.int64) * (total // nch)
    bounds = np.clip(edges[None, :] - cu[:-1, None], 0, np.diff(cu)[:, None])
    sizes = np.diff(bounds, axis=1)
    owner = chunk_owner(cp_size, "zigzag")
    n = cu.shape[0] - 1
    seg_len = np.zeros((cp_size, n), dtype=np.int64)
    for c in range(nch):
        seg_len[owner[c]] += sizes[:, c]
    first_len = sizes[:, :cp_size].T.copy()
    seg_start = np.cumsum(seg_len, axis=1) - seg_len
    split, doc_rank = np.ones(n, dtype=bool), np.full(n, -1, dtype=np.int64)
    return CPLayout(
        cu, cp_size, "zigzag", chunk_bounds(sizes), owner, seg_len, first_len, seg_start, split, doc_rank,
        {"row_chunks": True},
    )  # fmt: skip


def build_layout(padded_cu: np.ndarray, cp_size: int, spec: dict) -> CPLayout:
    """The `CPLayout` of a padded row (``padded_cu``: the padded documents' boundaries) for layout ``spec``."""
    kind = spec["kind"]
    if kind == "sequence" and cp_size > 1:
        return row_chunk_layout(padded_cu, cp_size)
    if kind != "hybrid":  # zigzag, and a CP size of 1 (every token on rank 0)
        return CPLayout.build(padded_cu, cp_size, kind="zigzag")
    from balancer.planning.cost.hybrid import explicit_layout

    options = explicit_layout(np.diff(padded_cu), cp_size, spec)
    return CPLayout.from_spec(padded_cu, cp_size, options)
