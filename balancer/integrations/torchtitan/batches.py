"""One packed micro-batch as torchtitan's trainer takes it: `(input_dict, labels)`.

`input_dict["input"]` holds this rank's tokens `[1, T_local]` (its CP share under the project's layout),
`input_dict["positions"]` each token's position inside its document (0 at every document start: torchtitan's own
flex / varlen masks read the boundaries from there), and, unless turned off, `input_dict["attention_masks"]` a
:class:`PackedDocuments` that :class:`PackedAttention` reads (the micro-batch's global layout, this rank's place in
it and the CP process group). `labels` are the next-token targets, `-100` (torchtitan's `IGNORE_INDEX`) at each
document's last token and on filler or padding tokens, so torchtitan's global count of labels that are not ignored
is the step's loss-token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from balancer.training.collate import PackedCollator

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


@dataclass(frozen=True)
class PackedDocuments:
    """The packed documents of one micro-batch as the attention needs them: `layout` (`attention.CPLayout` of
    the whole micro-batch, global `cu_seqlens`), this rank's `cp_rank` in a group of `cp_size`, and `group` (the
    CP process group; None when `cp_size == 1`)."""

    layout: Any
    cp_rank: int
    cp_size: int
    group: Optional[Any] = None

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [n_docs + 1]: the documents' boundaries in the whole micro-batch (padding and fillers included)."""
        return torch.as_tensor(self.layout.cu_seqlens, dtype=torch.int32)


def to_torchtitan(batch: dict, group: Optional[Any], attention_masks: bool) -> tuple[dict, torch.Tensor]:
    """`(input_dict, labels)` of a `PackedCollator` batch; `group`: the batch's CP process group (None: no CP)."""
    inputs = {"input": batch["input_ids"], "positions": batch["position_ids"]}
    if attention_masks:
        inputs["attention_masks"] = PackedDocuments(batch["layout"], batch["cp_rank"], batch["cp_size"], group)
    return inputs, batch["labels"]


def filler_batch(collator: PackedCollator) -> dict:
    """A fully loss-masked micro-batch (every label ignored, no document's tokens): one filler row of `2 * cp`
    tokens per CP rank, cut by the collator's own layout like any micro-batch, so that every rank of the group
    holds some tokens and runs the same collectives as for a real micro-batch."""
    size = collator.cp_size
    rows = [{"input_ids": torch.zeros(2 * size, dtype=torch.int64), "filler": True} for _ in range(size)]
    return collator(rows)
