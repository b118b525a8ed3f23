"""CPLayout: which tokens of a packed batch each context-parallel (CP) rank holds.

This module is the single owner of the CP token layout; the collator and the attention functions use it.

Zigzag (default): every document is cut into ``2*cp`` contiguous chunks; rank ``r`` holds chunks ``r`` and
``2*cp-1-r``. With ``d = 2*cp*b + rem`` (``0 <= rem < 2*cp``) every chunk has ``b`` tokens and the ``rem`` remainder
tokens go one each, without padding, to
  - the first ``rem`` chunks (front chunks of ranks ``0..rem-1``) when ``rem <= cp``,
  - the last ``rem`` chunks (every rank's back chunk and the front chunks of ranks ``2cp-rem..cp-1``) when ``rem > cp``.
Per-rank token counts of a document then differ by at most one, and per-rank causal pair counts differ by at most
``(m-1)*(2b+1)+1`` with ``m = min(rem, 2cp-rem)`` (0 when ``rem == 0``): the least possible (checked by brute force
for cp <= 4) among dealings that keep token counts within one. Documents shorter than ``2*cp`` leave some chunks
empty; a rank may hold no token of a document, or of the whole batch.

Contiguous: every document is cut into ``cp`` contiguous chunks (the first ``d % cp`` one token longer), rank ``r``
holds chunk ``r``. Simple, but causal work grows with the rank.

Hybrid: documents chosen by :mod:`attention.placement` (the long ones, those no rank can take whole within
``max_tokens``, or an explicit ``split`` set such as the planner's cost-driven choice) are split as in zigzag; every
other document stays whole on one rank (stored as all its tokens in that rank's front chunk, so the zigzag
chunk-to-rank map holds for every document). Only split documents' K/V ever leave their rank: ``kv_counts`` /
``kv_rows`` describe the travelling part of each rank's K/V. The chunk rules themselves: :mod:`attention.geometry`.

On each rank, local tokens are ordered document by document, and within a document by chunk index (for zigzag: chunk
``r`` then chunk ``2cp-1-r``), so the local tokens of a document form one contiguous segment that is, as a sequence,
in document order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from numpy.typing import ArrayLike

from attention.backends import Pieces
from attention.geometry import KINDS, chunk_bounds, chunk_pairs, chunk_sizes
from attention.placement import check_options, hybrid_assignment

__all__ = ["CPLayout", "KINDS"]


def _ranges_to_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s+l)`` for every (s, l), vectorised."""
    lens = lens.astype(np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.cumsum(lens) - lens
    return np.repeat(starts.astype(np.int64) - offs, lens) + np.arange(total, dtype=np.int64)


def _check_cu_seqlens(cu_seqlens) -> np.ndarray:
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D integer array [n_docs+1], got shape {cu.shape} dtype {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if (np.diff(cu) < 0).any():
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu


def _refuse_removed(options: dict) -> None:
    """The cost-driven hybrid choice moved to the planner: name its new home instead of a TypeError."""
    if options:
        raise ValueError(
            f"CPLayout.build does not take {sorted(options)}: the cost-driven choice of a hybrid split is "
            "balancer.planning.cost.hybrid_split(lengths, cp, cost, method=...), whose answer goes in split=...; "
            "a layout spec with a cost resolves with balancer.planning.cost.explicit_layout(lengths, cp, spec)"
        )


@dataclass(eq=False)
class CPLayout:
    """Token layout of one packed batch over a CP group. Build it with :meth:`CPLayout.build`.

    Attributes: ``cu_seqlens`` (int64 [n_docs+1], global), ``cp_size``, ``kind``, ``bounds`` (int64
    [n_docs, n_chunks+1], chunk boundaries as offsets inside each document), ``owner`` (int64 [n_chunks], rank of each
    chunk), ``seg_len`` (int64 [cp, n_docs], tokens of each document on each rank), ``first_len`` (int64 [cp, n_docs],
    tokens of the rank's first chunk of each document), ``seg_start`` (int64 [cp, n_docs], local offset of each
    document's segment), ``split_docs`` (bool [n_docs]: True = spread over the whole group, False = whole on
    ``doc_rank``), ``doc_rank`` (int64 [n_docs], -1 for split documents), ``options`` (the kind's options).
    """

    cu_seqlens: np.ndarray
    cp_size: int
    kind: str
    bounds: np.ndarray
    owner: np.ndarray
    seg_len: np.ndarray
    first_len: np.ndarray
    seg_start: np.ndarray
    split_docs: np.ndarray
    doc_rank: np.ndarray
    options: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        cu_seqlens: ArrayLike,
        cp_size: int,
        kind: str = "zigzag",
        split_threshold: Optional[int] = None,
        max_tokens: Optional[int] = None,
        tolerance: Optional[float] = None,
        split: Optional[Sequence[int]] = None,
        **removed: Any,
    ) -> CPLayout:
        """Layout of packed documents ``cu_seqlens`` (ints [n_docs+1], starting at 0, non-decreasing) over
        ``cp_size`` ranks. ``split_threshold``, ``max_tokens`` (per rank), ``tolerance`` and ``split`` (the indices
        of the documents to split, e.g. ``balancer.planning.cost.hybrid_split``'s cost-driven choice) are hybrid
        options (see :mod:`attention.placement`); other kinds reject them. Vectorised for zigzag/contiguous; hybrid
        placement loops over documents (a few microseconds each)."""
        _refuse_removed(removed)
        cu = _check_cu_seqlens(cu_seqlens)
        lens = np.diff(cu)
        if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
        cp = int(cp_size)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        n = lens.shape[0]
        chosen, split_docs = split, np.ones(n, dtype=bool)
        doc_rank = np.full(n, -1, dtype=np.int64)
        options: dict = {}
        if kind == "hybrid":
            options = check_options(split_threshold, max_tokens, tolerance, chosen)
            split_docs, doc_rank = hybrid_assignment(lens, cp, options)
        else:
            for name, value in (
                ("split_threshold", split_threshold),
                ("max_tokens", max_tokens),
                ("tolerance", tolerance),
                ("split", chosen),
            ):
                if value is not None:
                    raise ValueError(f"{name} is an option of the hybrid layout only, not of kind {kind!r}")
        sizes, owner = chunk_sizes(lens, cp, kind, split_docs, doc_rank)
        nch = owner.shape[0]
        bounds = chunk_bounds(sizes)
        seg_len = np.zeros((cp, n), dtype=np.int64)
        first_len = np.zeros((cp, n), dtype=np.int64)
        for c in range(nch):  # loop over chunks, not documents
            seg_len[owner[c]] += sizes[:, c]
        for r in range(cp):
            first_len[r] = sizes[:, r]  # chunk r is rank r's first chunk
        seg_start = np.cumsum(seg_len, axis=1) - seg_len
        return cls(
            cu, cp, kind, bounds, owner.astype(np.int64), seg_len, first_len, seg_start, split_docs, doc_rank, options
        )

    @classmethod
    def from_spec(cls, cu_seqlens: ArrayLike, cp_size: int, spec: dict) -> CPLayout:
        """Build from a :meth:`layout_spec` dict (as a plan records it): ``{"kind": ..., **options}``."""
        if not isinstance(spec, dict) or "kind" not in spec:
            raise ValueError(f"a layout spec must be a dict with a 'kind', got {spec!r}")
        _refuse_removed({k: spec[k] for k in ("cost", "method") if k in spec})
        unknown = set(spec) - {"kind", "split_threshold", "max_tokens", "tolerance", "split"}
        if unknown:
            raise ValueError(f"unknown layout option(s) {sorted(unknown)} in {spec!r}")
        return cls.build(cu_seqlens, cp_size, **spec)

    def layout_spec(self) -> dict:
        """JSON-serialisable description ``{"kind": ..., **options}``: with the same ``cu_seqlens`` and ``cp_size``,
        :meth:`from_spec` re-derives this exact layout."""
        return {"kind": self.kind, **self.options}

    # ------------------------------------------------------------------ per-rank token information
    @property
    def num_docs(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        """Total tokens of the packed batch (all ranks)."""
        return int(self.cu_seqlens[-1])

    @property
    def local_counts(self) -> np.ndarray:
        """int64 [cp]: local token count of every rank."""
        return self.seg_len.sum(axis=1)

    def num_local_tokens(self, rank: int) -> int:
        return int(self.seg_len[self._check_rank(rank)].sum())

    def _check_rank(self, rank: int) -> int:
        if not 0 <= int(rank) < self.cp_size:
            raise ValueError(f"rank {rank} out of range for cp_size {self.cp_size}")
        return int(rank)

    def local_indices(self, rank: int) -> np.ndarray:
        """int64 [T_local]: global packed-token index of every local token of ``rank``, in local order."""
        rank = self._check_rank(rank)
        key = ("idx", rank)
        if key not in self._cache:
            chunks = np.nonzero(self.owner == rank)[0]  # increasing chunk order
            starts = self.cu_seqlens[:-1, None] + self.bounds[:, chunks]  # [n, k]
            lens = self.bounds[:, chunks + 1] - self.bounds[:, chunks]
            self._cache[key] = _ranges_to_index(starts.reshape(-1), lens.reshape(-1))
        return self._cache[key]

    def local_doc_ids(self, rank: int) -> np.ndarray:
        """int64 [T_local]: document id of every local token."""
        rank = self._check_rank(rank)
        return np.repeat(np.arange(self.num_docs, dtype=np.int64), self.seg_len[rank])

    def position_ids(self, rank: int) -> np.ndarray:
        """int64 [T_local]: position of every local token inside its document (for position_ids / RoPE)."""
        rank = self._check_rank(rank)
        return self.local_indices(rank) - np.repeat(self.cu_seqlens[:-1], self.seg_len[rank])

    def local_cu_seqlens(self, rank: int) -> np.ndarray:
        """int64 [n_docs+1]: local segment boundaries of every document on ``rank`` (empty segments included)."""
        rank = self._check_rank(rank)
        return np.concatenate([[0], np.cumsum(self.seg_len[rank])]).astype(np.int64)

    def work(self, causal: bool = True) -> np.ndarray:
        """int64 [cp]: attention (query, key) pairs each rank computes: causal pairs (key position <= query position,
        same document) or, non-causal, local tokens x document length."""
        if not causal:
            return (self.seg_len * np.diff(self.cu_seqlens)[None, :]).sum(axis=1)
        per_chunk = chunk_pairs(self.bounds[:, :-1], self.bounds[:, 1:]).sum(axis=0)
        out = np.zeros(self.cp_size, dtype=np.int64)
        np.add.at(out, self.owner, per_chunk)
        return out

    # ------------------------------------------------------------------ travelling K/V (split documents only)
    @property
    def kv_seg_len(self) -> np.ndarray:
        """int64 [cp, n_docs]: tokens of each document in each rank's travelling K/V (0 for whole documents)."""
        return self.seg_len * self.split_docs[None, :]

    @property
    def kv_counts(self) -> np.ndarray:
        """int64 [cp]: tokens of each rank's K/V that other ranks need (its tokens of split documents)."""
        return self.kv_seg_len.sum(axis=1)

    @property
    def all_split(self) -> bool:
        """True when every document is split (zigzag, contiguous): the travelling K/V is the whole local K/V."""
        return bool(self.split_docs.all())

    def kv_rows(self, rank: int) -> np.ndarray:
        """int64 [kv_counts[rank]]: local rows (into the rank's local tensors) of its travelling K/V, in order."""
        rank = self._check_rank(rank)
        key = ("kvrows", rank)
        if key not in self._cache:
            sel = self.split_docs
            self._cache[key] = _ranges_to_index(self.seg_start[rank][sel], self.seg_len[rank][sel])
        return self._cache[key]

    def kv_indices(self, rank: int) -> np.ndarray:
        """int64 [kv_counts[rank]]: global packed-token index of every travelling K/V row of ``rank``."""
        return self.local_indices(rank)[self.kv_rows(rank)]

    def to_travelling(self, rounds: list, kv_rank: int) -> list:
        """The same attention blocks (a list of ``Pieces`` against ``kv_rank``'s local keys, ``kv_rank`` another rank
        than the queries') with key ranges moved into ``kv_rank``'s travelling K/V (:meth:`kv_rows`). Unchanged when
        every document is split. Cached per list object."""
        if self.all_split or not rounds:
            return rounds
        key = ("travel", kv_rank, id(rounds))
        hit = self._cache.get(key)
        if hit is None or hit[0] is not rounds:
            kv_len = self.kv_seg_len[kv_rank]
            shift = self.seg_start[kv_rank] - (np.cumsum(kv_len) - kv_len)  # per document: local -> travelling
            docs = self.local_doc_ids(kv_rank)
            moved = [
                Pieces(p.q_start, p.q_len, p.k_start - shift[docs[p.k_start]], p.k_len, False, p.lo, p.hi, p.softcap)
                for p in rounds
            ]
            hit = self._cache[key] = (rounds, moved)
        return hit[1]

    def _kv_index(self, rank: int, device: torch.device) -> torch.Tensor:
        key = ("tkv", rank, str(device))
        if key not in self._cache:
            self._cache[key] = torch.from_numpy(self.kv_rows(rank)).to(device)
        return self._cache[key]

    def travelling(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of a local tensor ``x`` [T_local, ...] that travel (``x`` itself when every document is
        split)."""
        return x if self.all_split else x.index_select(0, self._kv_index(rank, x.device))

    def add_travelling_(self, dst: torch.Tensor, rank: int, src: torch.Tensor) -> None:
        """In place: ``dst[kv_rows(rank)] += src`` (the gradient of the travelling rows coming home)."""
        if self.all_split:
            dst += src.to(dst.dtype)
        else:
            dst.index_add_(0, self._kv_index(rank, dst.device), src.to(dst.dtype))

    # ------------------------------------------------------------------ tensors
    def _torch_index(self, rank: int, device: torch.device) -> torch.Tensor:
        key = ("tidx", rank, str(device))
        if key not in self._cache:
            self._cache[key] = torch.from_numpy(self.local_indices(rank)).to(device)
        return self._cache[key]

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """[T, ...] -> [T_local, ...]: the rows of the packed batch that ``rank`` holds, in local order."""
        rank = self._check_rank(rank)
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"shard: x has {x.shape[0]} rows, layout has {self.num_tokens} tokens")
        return x.index_select(0, self._torch_index(rank, x.device))

    def unshard(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`shard`: ``[part_rank0, part_rank1, ...]`` -> [T, ...] in global packed order."""
        if len(parts) != self.cp_size:
            raise ValueError(f"unshard: got {len(parts)} parts for cp_size {self.cp_size}")
        counts = self.local_counts
        for r, p in enumerate(parts):
            if p.shape[0] != counts[r]:
                raise ValueError(f"unshard: part {r} has {p.shape[0]} rows, rank {r} holds {counts[r]} tokens")
            if p.shape[1:] != parts[0].shape[1:] or p.dtype != parts[0].dtype:
                raise ValueError("unshard: parts must share trailing shape and dtype")
        out = parts[0].new_empty((self.num_tokens,) + tuple(parts[0].shape[1:]))
        for r, p in enumerate(parts):
            out.index_copy_(0, self._torch_index(r, out.device), p.to(out.device))
        return out

    # ------------------------------------------------------------------ attention blocks
    def pieces(self, q_rank: int, kv_rank: int, causal: bool) -> Pieces:
        """Attention blocks between the local queries of ``q_rank`` and the local keys of ``kv_rank``.

        Every block is one document's (query range, key range) in the two ranks' local tensors, with a mask that is
        either full or causal on a square block whose queries and keys are the same tokens (the diagonal). Blocks the
        mask leaves empty are left out; query ranges never overlap. For another rank's keys, only its travelling
        rows take part (:meth:`to_travelling` maps the key ranges into them).
        """
        q_rank, kv_rank = self._check_rank(q_rank), self._check_rank(kv_rank)
        key = ("pieces", q_rank, kv_rank, bool(causal))
        if key in self._cache:
            return self._cache[key]
        r, s = q_rank, kv_rank
        qs, ql = self.seg_start[r], self.seg_len[r]
        ks, kl = self.seg_start[s], self.seg_len[s]
        if not causal:
            p = Pieces(qs, ql, ks, kl, False)
        elif r == s:
            # the local segment of a document is, as a sequence, in document order: plain causal
            p = Pieces(qs, ql, qs, ql, True)
        elif self.kind == "contiguous":
            p = Pieces(qs, ql, ks, kl, False) if s < r else Pieces.empty()
        elif s < r:
            # key chunk s precedes both query chunks r and 2cp-1-r; key chunk 2cp-1-s follows both
            p = Pieces(qs, ql, ks, self.first_len[s], False)
        else:
            # s > r: both key chunks follow query chunk r and precede query chunk 2cp-1-r
            f = self.first_len[r]
            p = Pieces(qs + f, ql - f, ks, kl, False)
        p = p.nonempty()
        self._cache[key] = p
        return p

    def fingerprint(self) -> int:
        """A 63-bit hash of (cu_seqlens, cp_size, kind, options, placement), to check that all ranks use the same
        layout."""
        if "fp" not in self._cache:
            import hashlib
            import json

            head = f"{self.cp_size}:{json.dumps(self.layout_spec(), sort_keys=True)}".encode()
            h = hashlib.sha256(self.cu_seqlens.tobytes() + self.doc_rank.tobytes() + head).digest()
            self._cache["fp"] = int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
        return self._cache["fp"]
