"""Online-softmax merge of partial attention results: the one place partial (out, lse) pairs are combined.

Partial results over disjoint key sets merge exactly: ``lse = logaddexp(lse_a, lse_b)`` and
``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``. Accumulators are float32 (float64 for float64 inputs),
so precision does not degrade with the number of merged blocks. Rows with ``lse = -inf`` (no key seen) stay empty.
"""

from __future__ import annotations

import torch


def merge_(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """In place: fold a partial result into the accumulators. ``out`` [T, H, D] and ``lse`` [T, H] are the
    accumulators (float32/float64); ``blk_out`` [T, H, D] (any float dtype) and ``blk_lse`` [T, H] the block's."""
    new = torch.logaddexp(lse, blk_lse.to(lse.dtype))
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_blk = torch.exp(blk_lse.to(lse.dtype) - safe).unsqueeze(-1)
    out.mul_(w_old).add_(blk_out.to(out.dtype) * w_blk)
    lse.copy_(new)


class Accumulator:
    """Running merge of partial results for ``T`` query rows; ``add`` keeps the first block without a copy-merge."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
        if self.out is None or self.lse is None:
            self.out = blk_out.to(blk_lse.dtype, copy=True)
            self.lse = blk_lse.clone()
        else:
            merge_(self.out, self.lse, blk_out, blk_lse)
