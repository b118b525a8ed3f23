"""Loss normalisation for packed, planned, context-parallel training without an extra all-reduce.

The target is the mean token loss of an optimizer step: `sum over all loss tokens of the step of CE / N`, `N` the
step's global loss-token count (all DP ranks, all micro-batches, all CP ranks). Every rank computes, per micro-batch,
`sum over its local loss tokens of CE / N` and calls `backward()`; gradient accumulation adds the micro-batches, and
the DP/CP gradient reduction must then be a *sum* (not a mean) over the DP x CP ranks. The result is exactly the
gradient of the step's mean token loss - independent of how the plan spread tokens over ranks and micro-batches
(the 2024 gradient-accumulation bug was dividing each micro-batch by its own count). `N` comes from the plan
(`BalancedBatchSampler.step_loss_tokens(step)`): no communication needed. (DDP averages gradients over its ranks;
with DDP multiply the loss by the DP x CP world size, or use a sum-reducing comm hook.)

`reduction="sequence"` (LongAlign-style): every document's mean token loss gets the same weight,
`loss = sum over documents of the step of (sum of its CE / its loss tokens) / S`, where `S` is the number of
documents of the step with at least one loss token (`BalancedBatchSampler.step_num_sequences(step)`); a document
split into windows counts each window as a sequence. Needs per-token document ids (`seq_ids` from PackedCollator)
and the per-document global loss-token counts (`seq_loss_tokens`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

REDUCTIONS = ("global", "sum", "sequence")


def token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_loss_tokens_global: Optional[float] = None,
    ignore_index: int = -100,
    reduction: str = "global",
    *,
    seq_ids: Optional[torch.Tensor] = None,
    seq_loss_tokens: Optional[torch.Tensor] = None,
    num_sequences_global: Optional[int] = None,
) -> torch.Tensor:
    """Cross-entropy of pre-shifted targets (no further shift), normalised for a step.

    `logits` [..., T, V], `labels` [..., T] (pre-shifted, `ignore_index` where there is no target).
    - `reduction="global"`: `sum CE / num_loss_tokens_global` (the step's global loss-token count);
    - `reduction="sum"`: the plain sum (normalise yourself);
    - `reduction="sequence"`: `sum_t CE_t / seq_loss_tokens[seq_ids[t]] / num_sequences_global` (each document's
      mean loss weighted equally; see the module docstring).
    The CE is computed in float32 at least (float64 stays float64).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    lg = logits.reshape(-1, logits.shape[-1])
    if lg.dtype in (torch.float16, torch.bfloat16):
        lg = lg.float()
    lab = labels.reshape(-1)
    if reduction != "sequence":
        total = F.cross_entropy(lg, lab, ignore_index=ignore_index, reduction="sum")
        if reduction == "sum":
            return total
        if num_loss_tokens_global is None or num_loss_tokens_global <= 0:
            raise ValueError(f"reduction='global' needs num_loss_tokens_global > 0, got {num_loss_tokens_global!r}")
        return total / float(num_loss_tokens_global)
    if seq_ids is None or seq_loss_tokens is None or num_sequences_global is None:
        raise ValueError("reduction='sequence' needs seq_ids, seq_loss_tokens and num_sequences_global")
    if num_sequences_global <= 0:
        raise ValueError(f"num_sequences_global must be > 0, got {num_sequences_global!r}")
    ce = F.cross_entropy(lg, lab, ignore_index=ignore_index, reduction="none")
    sid = seq_ids.reshape(-1).to(lab.device)
    valid = (lab != ignore_index) & (sid >= 0)
    counts = seq_loss_tokens.to(device=lab.device, dtype=ce.dtype)
    denom = torch.where(valid, counts[sid.clamp(min=0)], torch.ones_like(ce))
    return torch.where(valid, ce / denom, torch.zeros_like(ce)).sum() / float(num_sequences_global)


def batch_loss(
    logits: torch.Tensor,
    batch: dict,
    num_loss_tokens_global: Optional[float] = None,
    reduction: str = "global",
    num_sequences_global: Optional[int] = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """`token_loss` on a PackedCollator batch (`labels`, `seq_ids`, `seq_loss_tokens` taken from it)."""
    return token_loss(
        logits,
        batch["labels"],
        num_loss_tokens_global,
        ignore_index=ignore_index,
        reduction=reduction,
        seq_ids=batch.get("seq_ids"),
        seq_loss_tokens=batch.get("seq_loss_tokens"),
        num_sequences_global=num_sequences_global,
    )
