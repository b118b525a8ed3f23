"""Index objects a sampler yields beyond plain ints, and the dataset wrapper that understands them.

- :class:`Span` (doc, start, end): part of a document (the plan split or truncated it);
- :class:`Member`: a whole document index (an int) that also carries its micro-batch's CP group;
- :class:`Filler` (row): a loss-masked filler row (a plan's `filler_rows`), masked by the collator;
- :class:`CPGroup` (start, size, rank): the group of pool ranks `[start, start + size)` a micro-batch runs on, and
  this rank's place in it. With dynamic CP the group changes per micro-batch; the sampler attaches it to every
  index it yields, `SpanDataset` copies it into each item (`item["cp_group"]`), and `PackedCollator` shards the
  batch for that group. Index objects pickle, so all of this works with DataLoader workers.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class CPGroup(NamedTuple):
    """A CP group of pool ranks `[start, start + size)`; `rank` is this rank's index in it (its `cp_rank`)."""

    start: int
    size: int
    rank: int

    @property
    def key(self) -> tuple[int, int]:
        """`(start, size)`: the key of `balancer.cp_groups(topology)`."""
        return (self.start, self.size)


class Member(int):
    """A whole document's dataset index (it is an int) carrying the CP group of its micro-batch."""

    group: CPGroup

    def __new__(cls, index: int, group: CPGroup) -> Member:
        obj = super().__new__(cls, index)
        obj.group = group
        return obj

    def __reduce__(self):
        return (Member, (int(self), tuple(self.group)))

    def __repr__(self) -> str:
        return f"Member({int(self)}, group={tuple(self.group)})"


class Span:
    """Part `[start, end)` of document `doc`; yielded for documents the plan splits or truncates.

    Converting it to an int raises: a dataset that does not know spans must be wrapped in :class:`SpanDataset`.
    """

    __slots__ = ("doc", "start", "end", "group")

    def __init__(self, doc: int, start: int, end: int, group: Optional[CPGroup] = None) -> None:
        self.doc, self.start, self.end = int(doc), int(start), int(end)
        self.group = None if group is None else CPGroup(*group)

    def __index__(self) -> int:
        raise TypeError(
            f"{self!r} is part of a document (the plan split or truncated it): wrap the dataset in "
            "balancer.SpanDataset(dataset) so it returns that token range"
        )

    __int__ = __index__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Span) and (self.doc, self.start, self.end) == (other.doc, other.start, other.end)

    def __hash__(self) -> int:
        return hash((self.doc, self.start, self.end))

    def __repr__(self) -> str:
        return f"Span(doc={self.doc}, start={self.start}, end={self.end})"

    def __reduce__(self):
        return (Span, (self.doc, self.start, self.end, None if self.group is None else tuple(self.group)))


class Filler:
    """A loss-masked filler row: a copy of row `row` that a plan made with `filler_rows=True` places so that every
    replica gets a micro-batch; `SpanDataset` returns the row's item with `filler` set, which `PackedCollator`
    turns into tokens of no document whose labels are all ignored. Converting it to an int raises (a plain dataset
    would silently return the real row a second time)."""

    __slots__ = ("row",)

    def __init__(self, row: int) -> None:
        self.row = int(row)

    def __index__(self) -> int:
        raise TypeError(
            f"{self!r} is a loss-masked filler row: wrap the dataset in balancer.SpanDataset(dataset) so the collator "
            "masks it"
        )

    __int__ = __index__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Filler) and self.row == other.row

    def __hash__(self) -> int:
        return hash(("filler", self.row))

    def __repr__(self) -> str:
        return f"Filler(row={self.row})"

    def __reduce__(self):
        return (Filler, (self.row,))


class SpanDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset: `ds[i]` as before, `ds[Span(d, a, b)]` -> item `d` with `input_ids` (and `labels`,
    when present) cut to tokens `[a, b)`. An index carrying a CP group (:class:`Member`, or a Span with a group)
    also sets `item["cp_group"]` (a :class:`CPGroup`), which `PackedCollator` shards the batch for; items must then
    be dicts."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx):
        if isinstance(idx, Filler):
            item = self.dataset[idx.row]
            if not isinstance(item, dict) and not hasattr(item, "keys"):
                raise TypeError(f"dataset item {idx.row} is a {type(item).__name__}: filler rows need dict items")
            return {**dict(item), "filler": True}
        group = getattr(idx, "group", None)
        if isinstance(idx, Member):
            return _with_group(self.dataset[int(idx)], group, int(idx))
        if not isinstance(idx, Span):
            return self.dataset[idx]
        item = dict(_with_group(self.dataset[idx.doc], group, idx.doc))
        for key in ("input_ids", "labels"):
            if key in item and item[key] is not None:
                x = item[key]
                n = len(x)
                if idx.end > n:
                    raise ValueError(
                        f"{idx!r} is beyond document {idx.doc}'s {n} tokens: the lengths given to the "
                        "sampler do not match the dataset"
                    )
                item[key] = x[idx.start : idx.end]
        return item


def _with_group(item, group: Optional[CPGroup], index: int):
    if group is None:
        return item
    if not isinstance(item, dict) and not hasattr(item, "keys"):
        raise TypeError(
            f"dataset item {index} is a {type(item).__name__}: with dynamic CP groups the items must be dicts "
            "(the micro-batch's CP group travels in item['cp_group'])"
        )
    item = dict(item)
    item["cp_group"] = group
    return item
