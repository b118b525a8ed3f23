"""PackedCollator: dataset items -> one packed micro-batch, already cut into this CP rank's share.

The items of a micro-batch are concatenated into one sequence (batch size 1) in the order the sampler gives them.
Everything that depends on the document structure is computed on the full packed sequence *before* sharding, then
every tensor is sharded with the CP layout (`attention.CPLayout`, the only owner of the layout):

- `labels[t]` is the next-token target: `labels_or_ids[t + 1]` inside a document and `ignore_index` at each
  document's last token (its next token belongs to another document). The targets are pre-shifted because after CP
  sharding a token's successor is usually on another rank; feed them to the loss *without* a further shift (for a
  transformers model: `labels=lab, shift_labels=lab`, or `balancer.loss.token_loss`). Items with their own `labels`
  (aligned with `input_ids`, -100 for untrained positions, Hugging Face convention) are shifted the same way.
- `position_ids` is each token's position inside its document (RoPE needs the true positions).
- `seq_ids` is the index of each token's document in the micro-batch (-1 for padding) and `seq_loss_tokens` the
  loss-token count of every document (global): what the per-sequence loss needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional, overload

import numpy as np
import torch

from balancer.planning.cost.hybrid import check_cost_spec, explicit_layout


def _checked_spec(spec: dict, cp_size: int) -> dict:
    """The layout spec, validated (a bad option fails here, naming it). A cost-driven hybrid spec (`cost`,
    `method`) stays as given: every micro-batch resolves it into an explicit split (`explicit_layout`)."""
    from attention.layout import CPLayout

    if spec.get("cost") is not None:
        return check_cost_spec(spec)
    return CPLayout.from_spec([0], cp_size, spec).layout_spec()


class PackedCollator:
    """`collate_fn` for `DataLoader(dataset, batch_sampler=BalancedBatchSampler(...), collate_fn=...)`.

    Returns a dict for this CP rank: `input_ids`, `position_ids`, `labels`, `seq_ids` ([1, T_local] int64),
    global `cu_seqlens` (int32 [n_docs+1], padding included as a last document), `max_seqlen`, `layout`
    (`attention.CPLayout`), `num_tokens` (real tokens, all CP ranks), `num_loss_tokens` (targets != ignore_index,
    all CP ranks), `num_pad_tokens`, `seq_loss_tokens` (int64 [n_docs]), `num_sequences` (documents with >= 1
    loss token), and the CP group the batch runs on: `cp_rank`, `cp_size` and `cp_group_key` (`(start, size)` in
    pool ranks, the key of `balancer.cp_groups(topology)`).

    The group: items carrying `item["cp_group"]` (set by `SpanDataset` from the indices a dynamic-CP sampler yields)
    decide it per batch; otherwise it is the fixed group of this collator, `(dp_rank * cp_size, cp_size)` with
    `cp_rank` in it.

    `layout`: "zigzag" (default), "contiguous", "hybrid", or a layout spec dict such as
    `{"kind": "hybrid", "split_threshold": 4096, "max_tokens": None}` (`CPLayout.layout_spec()`, as a plan records
    it); every micro-batch's layout is `CPLayout.from_spec(cu_seqlens, cp_size, spec)`.

    `pad_to_multiple_of`: pad the packed sequence to a multiple of this many tokens; the pad tokens
    (`pad_token_id`) form their own last document, with `ignore_index` labels and positions 0..p-1, counted in
    `num_pad_tokens` and not in `num_tokens`.
    """

    def __init__(
        self,
        cp_rank: int = 0,
        cp_size: int = 1,
        layout: str = "zigzag",
        pad_to_multiple_of: Optional[int] = None,
        ignore_index: int = -100,
        pad_token_id: int = 0,
        dp_rank: int = 0,
    ) -> None:
        from attention.geometry import KINDS

        if isinstance(cp_size, bool) or int(cp_size) != cp_size or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
        if isinstance(cp_rank, bool) or int(cp_rank) != cp_rank or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank {cp_rank!r} out of range for cp_size {cp_size}")
        spec = dict(layout) if isinstance(layout, dict) else {"kind": layout}
        if spec.get("kind") not in KINDS:
            raise ValueError(f"layout must be one of {KINDS} or a layout spec dict, got {layout!r}")
        spec = _checked_spec(spec, int(cp_size))
        if pad_to_multiple_of is not None and (int(pad_to_multiple_of) != pad_to_multiple_of or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        if isinstance(dp_rank, bool) or int(dp_rank) != dp_rank or dp_rank < 0:
            raise ValueError(f"dp_rank must be a non-negative int, got {dp_rank!r}")
        self.cp_rank, self.cp_size, self.kind = int(cp_rank), int(cp_size), spec["kind"]
        self.layout_spec = spec
        self.dp_rank = int(dp_rank)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.ignore_index = int(ignore_index)
        self.pad_token_id = int(pad_token_id)

    @overload
    @staticmethod
    def _ids(item: Any, i: int, key: str, required: Literal[True]) -> torch.Tensor: ...

    @overload
    @staticmethod
    def _ids(item: Any, i: int, key: str, required: bool) -> Optional[torch.Tensor]: ...

    @staticmethod
    def _ids(item: Any, i: int, key: str, required: bool) -> Optional[torch.Tensor]:
        if isinstance(item, dict):
            x = item.get(key)
        else:
            x = getattr(item, key, None)
        if x is None:
            if required:
                what = f"keys {sorted(item)}" if isinstance(item, dict) else f"type {type(item).__name__}"
                raise ValueError(f"item {i} of the micro-batch has no '{key}' ({what})")
            return None
        if not isinstance(x, torch.Tensor):
            x = np.asarray(x)
            if not x.flags.writeable:  # rows of a `datasets` batch are read-only views of its Arrow buffers
                x = x.copy()  # torch cannot share read-only memory (it warns); the ids are copied to int64 anyway
        t = torch.as_tensor(x)
        if t.dim() != 1:
            raise ValueError(f"item {i}: '{key}' must be 1-D, got shape {tuple(t.shape)}")
        if t.numel() == 0:
            return t.to(torch.int64)
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"item {i}: '{key}' must hold integer token ids, got {t.dtype}")
        return t.to(torch.int64)

    def pack(self, items: Sequence[Any]) -> dict:
        """The full packed micro-batch (no CP sharding): `input_ids`, `labels`, `position_ids`, `seq_ids` [T],
        `cu_seqlens`, counts."""
        if len(items) == 0:
            raise ValueError("empty micro-batch: no items to collate")
        fillers = [it for it in items if isinstance(it, dict) and it.get("filler")]
        if fillers:  # loss-masked filler rows (a plan's filler_rows): after the documents, like padding
            items = [it for it in items if not (isinstance(it, dict) and it.get("filler"))]
        ids, labs = [], []
        for i, it in enumerate(items):
            x = self._ids(it, i, "input_ids", True)
            if x.numel() == 0:
                raise ValueError(f"item {i} of the micro-batch has empty input_ids (documents need >= 1 token)")
            lab = self._ids(it, i, "labels", False)
            if lab is None:
                lab = x
            elif lab.shape != x.shape:
                raise ValueError(f"item {i}: labels has {lab.numel()} entries, input_ids {x.numel()}")
            shifted = torch.full_like(x, self.ignore_index)
            shifted[:-1] = lab[1:]
            ids.append(x)
            labs.append(shifted)
        lens = [len(x) for x in ids]
        seq_loss = [int((lb != self.ignore_index).sum()) for lb in labs]
        n_real = sum(lens)
        filled = self._fillers(fillers, len(items), ids, labs, lens)
        pad = 0
        if self.pad_to_multiple_of:
            pad = -(n_real + filled) % int(self.pad_to_multiple_of)
        if pad:
            ids.append(torch.full((pad,), self.pad_token_id, dtype=torch.int64))
            labs.append(torch.full((pad,), self.ignore_index, dtype=torch.int64))
            lens.append(pad)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        seq = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
        seq[n_real:] = -1  # filler rows and padding belong to no document
        return {
            "input_ids": torch.cat(ids),
            "labels": torch.cat(labs),
            "position_ids": torch.from_numpy(np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lens)),
            "seq_ids": torch.from_numpy(seq),
            "cu_seqlens": cu,
            "num_tokens": n_real,
            "num_loss_tokens": sum(seq_loss),
            "num_pad_tokens": pad,
            "num_filler_tokens": filled,
            "seq_loss_tokens": torch.tensor(seq_loss, dtype=torch.int64),
            "num_sequences": sum(1 for c in seq_loss if c > 0),
            "max_seqlen": int(max(lens)),
        }

    def _fillers(self, fillers: list, first: int, ids: list, labs: list, lens: list) -> int:
        """Append filler rows (items with `filler` set: `SpanDataset` for a plan's `Filler` index) to `ids`,
        `labs` and `lens`, each its own sequence with every label `ignore_index`; their token count."""
        count = 0
        for j, it in enumerate(fillers):
            x = self._ids(it, first + j, "input_ids", True)
            ids.append(x)
            labs.append(torch.full_like(x, self.ignore_index))
            lens.append(len(x))
            count += len(x)
        return count

    def __call__(self, items: Sequence[Any]) -> dict:
        from attention.layout import CPLayout

        r, size, key = self._group(items)
        full = self.pack(items)
        spec = explicit_layout(np.diff(full["cu_seqlens"]), size, self.layout_spec)
        layout = CPLayout.from_spec(full["cu_seqlens"], size, spec)
        out: dict[str, Any] = {k: layout.shard(full[k], r)[None] for k in ("input_ids", "labels", "seq_ids")}
        out["position_ids"] = torch.from_numpy(layout.position_ids(r))[None]
        out.update(
            cu_seqlens=torch.from_numpy(full["cu_seqlens"].astype(np.int32)),
            max_seqlen=full["max_seqlen"],
            layout=layout,
            num_tokens=full["num_tokens"],
            num_loss_tokens=full["num_loss_tokens"],
            num_pad_tokens=full["num_pad_tokens"],
            num_filler_tokens=full["num_filler_tokens"],
            seq_loss_tokens=full["seq_loss_tokens"],
            num_sequences=full["num_sequences"],
            cp_rank=r,
            cp_size=size,
            cp_group_key=key,
        )
        return out

    def _group(self, items: Sequence[Any]) -> tuple[int, int, tuple[int, int]]:
        """(cp_rank, cp_size, cp_group_key) of this batch: from the items' `cp_group`, else this collator's."""
        groups = {tuple(it["cp_group"]) for it in items if isinstance(it, dict) and it.get("cp_group") is not None}
        if not groups:
            return self.cp_rank, self.cp_size, (self.dp_rank * self.cp_size, self.cp_size)
        if len(groups) > 1 or any(not isinstance(it, dict) or it.get("cp_group") is None for it in items):
            raise ValueError(f"the items of one micro-batch name different CP groups: {sorted(groups)}")
        start, size, rank = groups.pop()
        return int(rank), int(size), (int(start), int(size))
