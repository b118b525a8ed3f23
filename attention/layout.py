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

On each rank, local tokens are ordered document by document, and within a document by chunk index (for zigzag: chunk
``r`` then chunk ``2cp-1-r``), so the local tokens of a document form one contiguous segment that is, as a sequence,
in document order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .backends import Pieces

KINDS = ("zigzag", "contiguous")


def _ranges_to_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s+l)`` for every (s, l), vectorised."""
    lens = lens.astype(np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.cumsum(lens) - lens
    return np.repeat(starts.astype(np.int64) - offs, lens) + np.arange(total, dtype=np.int64)


@dataclass(eq=False)
class CPLayout:
    """Token layout of one packed batch over a CP group. Build it with :meth:`CPLayout.build`.

    Attributes: ``cu_seqlens`` (int64 [n_docs+1], global), ``cp_size``, ``kind``, ``bounds`` (int64
    [n_docs, n_chunks+1], chunk boundaries as offsets inside each document), ``owner`` (int64 [n_chunks], rank of each
    chunk), ``seg_len`` (int64 [cp, n_docs], tokens of each document on each rank), ``first_len`` (int64 [cp, n_docs],
    tokens of the rank's first chunk of each document), ``seg_start`` (int64 [cp, n_docs], local offset of each
    document's segment).
    """

    cu_seqlens: np.ndarray
    cp_size: int
    kind: str
    bounds: np.ndarray
    owner: np.ndarray
    seg_len: np.ndarray
    first_len: np.ndarray
    seg_start: np.ndarray
    _cache: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, cu_seqlens, cp_size: int, kind: str = "zigzag") -> CPLayout:
        """Layout of packed documents ``cu_seqlens`` (ints [n_docs+1], starting at 0, non-decreasing) over
        ``cp_size`` ranks. Vectorised: O(n_docs * cp_size) numpy work, no Python loop over documents or tokens."""
        if isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = cu_seqlens.detach().cpu().numpy()
        cu = np.asarray(cu_seqlens)
        if cu.ndim != 1 or cu.shape[0] < 1 or not np.issubdtype(cu.dtype, np.integer):
            raise ValueError(
                f"cu_seqlens must be a 1-D integer array [n_docs+1], got shape {cu.shape} dtype {cu.dtype}"
            )
        cu = cu.astype(np.int64)
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
        lens = np.diff(cu)
        if (lens < 0).any():
            raise ValueError("cu_seqlens must be non-decreasing")
        if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
        cp = int(cp_size)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

        n = lens.shape[0]
        if kind == "zigzag":
            nch = 2 * cp
            b, rem = lens // nch, lens % nch
            j = np.arange(nch)[None, :]
            extra = np.where((rem <= cp)[:, None], j < rem[:, None], j >= (nch - rem)[:, None])
            owner = np.minimum(np.arange(nch), nch - 1 - np.arange(nch))
        else:
            nch = cp
            b, rem = lens // nch, lens % nch
            extra = np.arange(nch)[None, :] < rem[:, None]
            owner = np.arange(nch)
        sizes = b[:, None] + extra.astype(np.int64)  # [n, nch]
        bounds = np.zeros((n, nch + 1), dtype=np.int64)
        np.cumsum(sizes, axis=1, out=bounds[:, 1:])
        seg_len = np.zeros((cp, n), dtype=np.int64)
        first_len = np.zeros((cp, n), dtype=np.int64)
        for c in range(nch):  # loop over chunks, not documents
            seg_len[owner[c]] += sizes[:, c]
        for r in range(cp):
            first_len[r] = sizes[:, r]  # chunk r is rank r's first chunk
        seg_start = np.cumsum(seg_len, axis=1) - seg_len
        return cls(cu, cp, kind, bounds, owner.astype(np.int64), seg_len, first_len, seg_start)

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
        s, e = self.bounds[:, :-1], self.bounds[:, 1:]
        per_chunk = (e * (e + 1) - s * (s + 1)) // 2  # [n, nch]
        per_chunk = per_chunk.sum(axis=0)
        out = np.zeros(self.cp_size, dtype=np.int64)
        np.add.at(out, self.owner, per_chunk)
        return out

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
        mask leaves empty are left out; query ranges never overlap.
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
        """A 63-bit hash of (cu_seqlens, cp_size, kind), to check that all ranks use the same layout."""
        if "fp" not in self._cache:
            import hashlib

            h = hashlib.sha256(self.cu_seqlens.tobytes() + f"{self.cp_size}:{self.kind}".encode()).digest()
            self._cache["fp"] = int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
        return self._cache["fp"]
