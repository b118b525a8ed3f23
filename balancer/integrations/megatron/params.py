"""`BalancedPackedSeqParams`: Megatron's ``PackedSeqParams`` carrying the row's `attention.CPLayout`.

It is a ``megatron.core.packed_seq_params.PackedSeqParams`` (a dataclass subclass: every Megatron module that
takes one takes it) with one more field, ``cp_layout``, that `CPCoreAttention` reads to know which tokens each CP
rank holds (the hybrid layout's placement is not derivable from the ``cu_seqlens`` fields alone). Importing this
module imports megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class BalancedPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus ``cp_layout`` (the `attention.CPLayout` of the packed row, or None)."""

    cp_layout: Optional[Any] = None
