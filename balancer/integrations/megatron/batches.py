"""One balanced micro-batch in Megatron's packed-sequence contract, cut into this CP rank's share.

`megatron_batch` returns the dict Megatron's packed (THD) path reads: ``tokens``, ``labels``, ``loss_mask``,
``position_ids`` (``[1, T_local]``, positions restarting at every document), ``cu_seqlens`` and
``cu_seqlens_padded`` (int32 ``[1, n_docs+1]``, global, with the leading batch dimension Megatron's data loaders
give), ``max_seqlen`` (int32 ``[1]``: the longest padded document, never the row length, so a rotary table restarts
per document), and for a dynamic-CP micro-batch ``local_cp_size`` (int32 scalar, as Megatron's hybrid-CP schedule
sets it). Besides them, keys Megatron does not read: ``cp_rank``, ``cp_size``, ``cp_group_key`` (the key of
`balancer.cp_groups`), ``cp_layout`` (the `attention.CPLayout` of the row), ``layout`` (its name),
``num_tokens`` (real tokens, all ranks), ``num_pad_tokens`` (pad tokens the layout added, all ranks),
``num_loss_tokens`` (all ranks). `packed_seq_params` turns it into a real ``PackedSeqParams``.

Targets are pre-shifted (``labels[t]`` is the token after ``tokens[t]`` in its document) because after CP sharding
a token's successor usually lives on another rank; a document's last token, pad tokens and filler rows have
``loss_mask`` 0 and label 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from balancer.integrations.megatron.layouts import build_layout, check_layout, padded_lengths
from balancer.training.collate import PackedCollator
from balancer.training.indices import Filler, Span

IGNORE = -100


def _row(tokens, index: int) -> dict:
    row = tokens[index]
    if isinstance(row, dict) or hasattr(row, "keys"):
        return dict(row)
    return {"input_ids": row}


def _items(indices: Sequence[Any], tokens) -> list[dict]:
    """The dataset rows of a micro-batch's indices (ints, `Member`s, `Span`s cut to their token range, `Filler`s
    marked as loss-masked fillers)."""
    out = []
    for idx in indices:
        if isinstance(idx, Filler):
            out.append({**_row(tokens, idx.row), "filler": True})
            continue
        if isinstance(idx, Span):
            row = _row(tokens, idx.doc)
            n = len(row["input_ids"])
            if not 0 <= idx.start < idx.end <= n:
                raise ValueError(f"{idx!r} is out of range for document {idx.doc} of {n} tokens")
            row = {k: row[k][idx.start : idx.end] for k in ("input_ids", "labels") if row.get(k) is not None}
            out.append(row)
            continue
        out.append(_row(tokens, int(idx)))
    return out


def _group(indices: Sequence[Any], cp_rank: int, cp_size: int) -> tuple[int, int, tuple[int, int], bool]:
    """(cp_rank, cp_size, group key, dynamic) of the micro-batch: from the indices' CP group when they carry one
    (dynamic CP), else the arguments'."""
    groups = {tuple(g) for g in (getattr(i, "group", None) for i in indices) if g is not None}
    if not groups:
        return cp_rank, cp_size, (0, cp_size), False
    if len(groups) > 1 or any(getattr(i, "group", None) is None for i in indices):
        raise ValueError(f"the items of one micro-batch name different CP groups: {sorted(groups)}")
    start, size, rank = groups.pop()
    if cp_size != 1 and (cp_size, cp_rank) != (size, rank):
        raise ValueError(
            f"cp_rank={cp_rank}, cp_size={cp_size} contradict the items' CP group (start {start}, size {size}, "
            f"rank {rank}): leave them at their defaults for a dynamic-CP plan"
        )
    return int(rank), int(size), (int(start), int(size)), True


@dataclass
class _Row:
    """The padded full row (all CP ranks) of a micro-batch."""

    tokens: torch.Tensor
    labels: torch.Tensor
    cu: np.ndarray
    padded_cu: np.ndarray
    num_tokens: int
    num_loss_tokens: int


def _padded_row(full: dict, cp_size: int, kind: str, pad_token_id: int) -> _Row:
    """The collator's packed row with the layout's padding inserted after each padded document."""
    cu = np.asarray(full["cu_seqlens"], dtype=np.int64)
    lens = np.diff(cu)
    plens = padded_lengths(lens, cp_size, kind)
    pcu = np.concatenate([[0], np.cumsum(plens)]).astype(np.int64)
    dest = torch.from_numpy(np.repeat(pcu[:-1] - cu[:-1], lens) + np.arange(cu[-1], dtype=np.int64))
    tokens = torch.full((int(pcu[-1]),), pad_token_id, dtype=torch.int64)
    labels = torch.full((int(pcu[-1]),), IGNORE, dtype=torch.int64)
    tokens[dest] = full["input_ids"]
    labels[dest] = full["labels"]
    return _Row(tokens, labels, cu, pcu, int(full["num_tokens"]), int(full["num_loss_tokens"]))


def _int32(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=torch.int32)


def megatron_batch(
    items: Sequence[Any],
    tokens: Any,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
    layout: str | dict = "zigzag",
    pad_token_id: int = 0,
) -> dict:
    """This CP rank's share of one micro-batch in Megatron's packed-sequence contract (module docstring).

    ``items``: the micro-batch's indices as `BalancedBatchSampler` / `BalancedScheduler` yield them (ints; `Span`s
    for parts of documents; `Member`s and `Span`s carrying the micro-batch's CP group under dynamic CP, which then
    sets ``cp_rank`` / ``cp_size``). ``tokens``: the dataset they index (a `ShardDataset`, or any sequence of token
    id arrays or of dicts with ``input_ids`` and optional ``labels``). ``layout``: ``"zigzag"``, ``"sequence"``,
    ``"hybrid"`` (or a hybrid spec dict with `CPLayout.build`'s hybrid options)."""
    spec = check_layout(layout)
    if isinstance(cp_size, bool) or int(cp_size) != cp_size or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if isinstance(cp_rank, bool) or int(cp_rank) != cp_rank or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank!r} out of range for cp_size {cp_size}")
    if len(items) == 0:
        raise ValueError("items is empty: a micro-batch needs at least one document")
    rank, size, key, dynamic = _group(items, int(cp_rank), int(cp_size))
    full = PackedCollator(ignore_index=IGNORE, pad_token_id=pad_token_id).pack(_items(items, tokens))  # fillers:
    # loss-masked sequences of their own after the documents
    row = _padded_row(full, size, spec["kind"], pad_token_id)
    cp_layout = build_layout(row.padded_cu, size, spec)
    labels = cp_layout.shard(row.labels, rank)
    mask = labels != IGNORE
    out: dict[str, Any] = {
        "tokens": cp_layout.shard(row.tokens, rank)[None],
        "labels": torch.where(mask, labels, torch.zeros_like(labels))[None],
        "loss_mask": mask.to(torch.float32)[None],
        "position_ids": torch.from_numpy(cp_layout.position_ids(rank))[None],
        "cu_seqlens": _int32(row.cu)[None],
        "cu_seqlens_padded": _int32(row.padded_cu)[None],
        "max_seqlen": _int32([int(np.diff(row.padded_cu).max())]),
    }
    if dynamic:
        out["local_cp_size"] = torch.tensor(size, dtype=torch.int32)
    out.update(
        cp_rank=rank, cp_size=size, cp_group_key=key, cp_layout=cp_layout, layout=spec["kind"],
        num_tokens=row.num_tokens, num_pad_tokens=int(row.padded_cu[-1] - row.cu[-1]),
        num_loss_tokens=row.num_loss_tokens,
    )  # fmt: skip
    return out


def packed_seq_params(batch: dict, *, cp_group: Optional[Any] = None) -> Any:
    """A ``megatron.core.packed_seq_params.PackedSeqParams`` (qkv_format ``"thd"``) for a `megatron_batch` dict:
    ``cu_seqlens_q/kv`` (real documents), ``cu_seqlens_q/kv_padded``, ``max_seqlen_q/kv`` (the longest padded
    document), and for a dynamic-CP micro-batch ``local_cp_size`` and ``cp_group`` (pass the micro-batch's process
    group, ``balancer.cp_groups(topology)[batch["cp_group_key"]]``; with a static plan ``cp_group`` is set when
    given). The object also carries the row's `CPLayout` as ``cp_layout``, which `CPCoreAttention` reads (Megatron
    ignores it)."""
    from balancer.integrations.megatron.params import BalancedPackedSeqParams

    missing = [k for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "cp_layout") if k not in batch]
    if missing:
        raise ValueError(f"batch has no {missing}: pass a dict made by megatron_batch")
    if cp_group is not None and hasattr(cp_group, "size") and cp_group.size() != batch["cp_size"]:
        raise ValueError(f"cp_group has {cp_group.size()} ranks but the batch is sharded for {batch['cp_size']}")
    cu = batch["cu_seqlens"].reshape(-1).to(torch.int32)
    pcu = batch["cu_seqlens_padded"].reshape(-1).to(torch.int32)
    longest = int(batch["max_seqlen"].reshape(-1)[0])
    local = batch.get("local_cp_size")
    return BalancedPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=pcu, cu_seqlens_kv_padded=pcu,
        max_seqlen_q=longest, max_seqlen_kv=longest, local_cp_size=None if local is None else int(local),
        cp_group=cp_group, cp_layout=batch["cp_layout"],
    )  # fmt: skip
