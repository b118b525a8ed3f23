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

RL and preference losses on fixed batches (`balancer.balance_batch`): `step_counts` takes the global counts of a
step from the plan, `rl_loss` weights per-token losses for token-mean, sequence-mean and per-group (GRPO)
normalisation, `sequence_logps` and `dpo_loss` give the DPO loss; docs/post-training.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from numpy.typing import ArrayLike

from balancer.limits import INT64_MAX, check_int, check_real

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan

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
    _check_labels(lab, lg.shape[-1], ignore_index)
    if reduction != "sequence":
        total = F.cross_entropy(lg, lab, ignore_index=ignore_index, reduction="sum")
        if reduction == "sum":
            return total
        if num_loss_tokens_global is None:
            raise ValueError("reduction='global' needs num_loss_tokens_global > 0, got None")
        return total / _whole_count("num_loss_tokens_global", num_loss_tokens_global)
    if seq_ids is None or seq_loss_tokens is None or num_sequences_global is None:
        raise ValueError("reduction='sequence' needs seq_ids, seq_loss_tokens and num_sequences_global")
    num_sequences_global = check_int("num_sequences_global", num_sequences_global, 1)
    if seq_ids.shape != labels.shape:
        raise ValueError(f"seq_ids {tuple(seq_ids.shape)} and labels {tuple(labels.shape)} do not match")
    ce = F.cross_entropy(lg, lab, ignore_index=ignore_index, reduction="none")
    sid = seq_ids.reshape(-1).to(lab.device)
    valid = (lab != ignore_index) & (sid >= 0)
    counts = seq_loss_tokens.to(device=lab.device, dtype=ce.dtype)
    denom = torch.where(valid, counts[sid.clamp(min=0)], torch.ones_like(ce))
    return torch.where(valid, ce / denom, torch.zeros_like(ce)).sum() / float(num_sequences_global)


def _whole_count(name: str, value) -> float:
    """A positive, finite, whole count (an int, or a float or tensor holding one, e.g. after an all-reduce)."""
    number = check_real(name, value, 0.0, float(INT64_MAX), open_low=True)
    if number != round(number):
        raise ValueError(f"{name} must be a whole count of tokens, got {number!r}")
    return number


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


# ---- RL and preference losses on fixed batches (balancer.balance_batch) ---------------------------------------------
# Every function below returns this micro-batch's share of the step's loss: summed over all micro-batches and DP x CP
# ranks of the step (gradient accumulation, then a SUM all-reduce), it is the loss of the whole step as the unpacked
# reference computes it, because every normaliser is a global count taken from the plan (`step_counts`).

RL_REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "group-mean-token-mean")


@dataclass(frozen=True)
class StepCounts:
    """Global counts of one step of a plan: `num_tokens` loss tokens, `num_sequences` documents and `num_groups`
    groups with at least one loss token; per document (global id) its loss tokens `doc_tokens` and group index
    `doc_group` (0..num_groups-1, -1 outside the step or without loss tokens); per group its loss tokens."""

    num_tokens: int
    num_sequences: int
    num_groups: int
    doc_tokens: np.ndarray
    doc_group: np.ndarray
    group_tokens: np.ndarray


def step_counts(plan: Plan, step: int, loss_tokens: ArrayLike, groups: ArrayLike | None = None) -> StepCounts:
    """The counts of `plan`'s step `step`: `loss_tokens[d]` is document d's loss-token count (e.g. its response
    tokens), `groups[d]` its group (a GRPO prompt, a preference pair; default: every document its own group). A
    document counts whole in the step holding it (plan with overflow="error" so documents are never cut). Bad input
    (a step the plan does not have, counts that are not whole, negative or above the document's length, a shape
    that is not one per document) raises a ValueError naming the argument."""
    if plan.num_steps < 1:
        raise ValueError("plan has no steps")
    step = check_int("step", step, -INT64_MAX)
    if not 0 <= step < plan.num_steps:
        raise ValueError(f"step={step} does not exist: the plan has {plan.num_steps} steps (0..{plan.num_steps - 1})")
    loss_tokens = _per_document("loss_tokens", loss_tokens, plan.num_docs)
    lengths = np.asarray(plan.lengths)
    bad = (loss_tokens < 0) | (loss_tokens > lengths)
    if bad.any():
        d = int(np.argmax(bad))
        raise ValueError(
            f"loss_tokens[{d}] = {int(loss_tokens[d])}: document {d} has {int(lengths[d])} tokens, so its loss-token "
            f"count must be in [0, {int(lengths[d])}] ({int(bad.sum())} documents are out of range)"
        )
    in_step = np.zeros(plan.num_docs, dtype=bool)
    in_step[plan.doc[plan.step_of_entry() == step]] = True
    counted = in_step & (loss_tokens > 0)
    group_id = np.arange(plan.num_docs) if groups is None else _per_document("groups", groups, plan.num_docs)
    present, dense = np.unique(group_id[counted], return_inverse=True)
    doc_group = np.full(plan.num_docs, -1, dtype=np.int64)
    doc_group[counted] = dense.reshape(-1)
    return StepCounts(
        num_tokens=int(loss_tokens[counted].sum()),
        num_sequences=int(counted.sum()),
        num_groups=len(present),
        doc_tokens=np.where(in_step, loss_tokens, 0),
        doc_group=doc_group,
        group_tokens=np.bincount(dense.reshape(-1), weights=loss_tokens[counted], minlength=len(present)),
    )


def _per_document(name: str, values, num_docs: int) -> np.ndarray:
    """A 1-D int64 array of `num_docs` integers (integer dtype: float counts are refused, also whole ones)."""
    arr = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if arr.shape != (num_docs,):
        raise ValueError(f"{name} must hold one integer per document of the plan ({num_docs}), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > INT64_MAX:
        raise ValueError(f"{name}[{int(np.argmax(arr))}] = {int(arr.max())} is beyond int64")
    return arr.astype(np.int64)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Log-probability of each pre-shifted target (`labels`, as PackedCollator makes them), 0 where there is none;
    float32 at least."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    lg = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    _check_labels(labels.reshape(-1), lg.shape[-1], ignore_index)
    valid = labels != ignore_index
    picked = torch.gather(lg.log_softmax(-1), -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def token_doc_ids(seq_ids: torch.Tensor, docs: Iterable[int]) -> torch.Tensor:
    """Global document id of every token of a collated micro-batch: `seq_ids` (PackedCollator) indexes the
    micro-batch's documents `docs` (in the order the plan lists them); -1 for padding."""
    table = torch.as_tensor(list(docs), dtype=torch.int64, device=seq_ids.device)
    _check_index("seq_ids", seq_ids, len(table), "docs has")
    return torch.where(seq_ids >= 0, table[seq_ids.clamp(min=0)], torch.full_like(seq_ids, -1))


def rl_loss(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    counts: StepCounts,
    reduction: str = "token-mean",
) -> torch.Tensor:
    """This micro-batch's share of the step's RL loss from per-token losses (e.g. `-advantage * ratio`, clipped):
    - "token-mean": `sum over the step's loss tokens / num_tokens`;
    - "seq-mean-token-mean": every document's token-mean, averaged over the step's documents;
    - "seq-mean-token-sum": every document's token-sum, averaged over the documents;
    - "group-mean-token-mean": every group's token-mean (all its documents' tokens), averaged over the groups (GRPO
      per-prompt normalisation).
    `loss_mask` marks loss tokens, `doc_ids` the global document of each token (`token_doc_ids`). A shape
    mismatch, a document outside the plan, or loss tokens of a document that `counts` does not count in its step
    (counts of another step) raise a ValueError naming the argument."""
    if reduction not in RL_REDUCTIONS:
        raise ValueError(f"reduction must be one of {RL_REDUCTIONS}, got {reduction!r}")
    if not isinstance(counts, StepCounts):
        raise ValueError(f"counts must be the StepCounts of step_counts(plan, step, ...), got {type(counts).__name__}")
    if not per_token.shape == loss_mask.shape == doc_ids.shape:
        raise ValueError(
            f"per_token {tuple(per_token.shape)}, loss_mask {tuple(loss_mask.shape)} and doc_ids "
            f"{tuple(doc_ids.shape)} must have one shape (one entry per token)"
        )
    mask = loss_mask.bool() & (doc_ids >= 0)
    doc = doc_ids.clamp(min=0).cpu().numpy()
    _check_step_docs(doc[mask.cpu().numpy()], counts)
    if reduction == "token-mean":
        weight = np.full(doc.shape, 1.0 / max(counts.num_tokens, 1))
    elif reduction == "seq-mean-token-mean":
        weight = 1.0 / np.maximum(counts.doc_tokens[doc], 1) / max(counts.num_sequences, 1)
    elif reduction == "seq-mean-token-sum":
        weight = np.full(doc.shape, 1.0 / max(counts.num_sequences, 1))
    else:
        group = counts.doc_group[doc]
        weight = 1.0 / np.maximum(counts.group_tokens[np.maximum(group, 0)], 1) / max(counts.num_groups, 1)
    w = torch.as_tensor(weight, dtype=per_token.dtype, device=per_token.device)
    return torch.where(mask, per_token * w, torch.zeros_like(per_token)).sum()


def sequence_logps(
    token_logps: torch.Tensor, seq_ids: torch.Tensor, num_sequences: int, cp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """[num_sequences] summed log-probabilities of every document of a micro-batch (padding dropped). With CP each
    rank holds part of every document: pass `cp_group` and the sums are all-reduced over it with
    `torch.distributed.nn.functional.all_reduce` (which carries the gradient back to every rank's tokens); every CP
    rank then holds the same sequence values, so give `dpo_loss` the CP size."""
    num_sequences = check_int("num_sequences", num_sequences)
    if token_logps.shape != seq_ids.shape:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and seq_ids {tuple(seq_ids.shape)} do not match")
    _check_index("seq_ids", seq_ids, num_sequences, "num_sequences is")
    sid = seq_ids.reshape(-1)
    keep = sid >= 0
    out = torch.zeros(num_sequences, dtype=token_logps.dtype, device=token_logps.device)
    out = out.index_add(0, sid[keep], token_logps.reshape(-1)[keep])
    if cp_group is not None:
        from torch.distributed.nn.functional import all_reduce

        out = all_reduce(out, group=cp_group)
    return out


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    num_pairs_global: int,
    cp_size: int = 1,
) -> torch.Tensor:
    """This micro-batch's share of the step's DPO loss: `sum over its pairs of -log sigmoid(beta * ((chosen -
    ref_chosen) - (rejected - ref_rejected))) / num_pairs_global` (sequence log-probabilities; the step's pair
    count from `step_counts(..., groups=pair ids).num_groups`). Keep pairs in one micro-batch
    (`balance_batch(..., groups=pair_ids, keep="micro_batch")`). With CP (sequence sums all-reduced by
    `sequence_logps(..., cp_group=...)`) every CP rank computes the same loss and the all-reduce's backward adds
    their gradients: `cp_size` divides each rank's copy so the summed gradient is the step's."""
    beta = check_real("beta", beta, open_low=True)
    num_pairs_global = check_int("num_pairs_global", num_pairs_global, 1)
    cp_size = check_int("cp_size", cp_size, 1)
    shapes = [tuple(t.shape) for t in (chosen, rejected, ref_chosen, ref_rejected)]
    if len(set(shapes)) != 1 or len(shapes[0]) != 1:
        raise ValueError(
            "chosen, rejected, ref_chosen and ref_rejected must be 1-D with one entry per pair, got shapes "
            + ", ".join(map(str, shapes))
        )
    if shapes[0][0] > num_pairs_global:
        raise ValueError(
            f"num_pairs_global={num_pairs_global} is below the {shapes[0][0]} pairs of this micro-batch alone: "
            "pass the step's pair count (step_counts(..., groups=pair ids).num_groups)"
        )
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return -F.logsigmoid(margin).sum() / float(num_pairs_global * cp_size)


def _check_index(name: str, ids: torch.Tensor, size: int, what: str) -> None:
    """`ids` (-1 = padding) inside [-1, size)."""
    if ids.numel() and (int(ids.max()) >= size or int(ids.min()) < -1):
        bad = int(ids.max()) if int(ids.max()) >= size else int(ids.min())
        raise ValueError(f"{name} holds {bad}, but {what} {size} (ids must be in [0, {size}), or -1 for padding)")


def _check_step_docs(loss_docs: np.ndarray, counts: StepCounts) -> None:
    """Every document with loss tokens here is counted in the step, with no more loss tokens than counted."""
    if not loss_docs.size:
        return
    if int(loss_docs.max()) >= len(counts.doc_tokens):
        raise ValueError(
            f"doc_ids holds document {int(loss_docs.max())}, but the plan of counts has {len(counts.doc_tokens)}"
        )
    here = np.bincount(loss_docs, minlength=len(counts.doc_tokens))
    outside = (here > 0) & (counts.doc_group < 0)
    if outside.any():
        d = int(np.argmax(outside))
        raise ValueError(
            f"doc_ids: document {d} has loss tokens in this micro-batch, but counts (step_counts of one step) does not "
            "count it: it is in another step, or its loss_tokens count is 0; pass the counts of this micro-batch's step"
        )
    over = here > counts.doc_tokens
    if over.any():
        d = int(np.argmax(over))
        raise ValueError(
            f"loss_mask marks {int(here[d])} loss tokens of document {d} in this micro-batch, more than the "
            f"{int(counts.doc_tokens[d])} that counts records for it (loss_tokens given to step_counts)"
        )


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every target a token id of the logits' vocabulary (or `ignore_index`): on CUDA an id beyond it is a
    device-side assert that ends the process, so it is refused here naming the id."""
    if not labels.numel():
        return
    valid = labels[labels != ignore_index]
    if valid.numel() and (int(valid.max()) >= vocab or int(valid.min()) < 0):
        bad = int(valid.max()) if int(valid.max()) >= vocab else int(valid.min())
        raise ValueError(
            f"labels holds token id {bad}, outside the logits' vocabulary of {vocab} ids (ignore_index={ignore_index})"
        )
