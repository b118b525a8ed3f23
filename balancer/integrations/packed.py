"""What the framework integrations share: packed micro-batches of prompt + completion sequences, their per-token
log-probabilities through the project's attention, and process-wide sums.

A sequence is packed as one document: its prompt tokens (no loss) then its completion tokens (the loss tokens).
`PackedCollator` shifts the labels per document, so the label at packed position t is the completion token at
t + 1, and the log-probability read there is exactly the one a padded forward gives that completion token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from balancer.training.collate import PackedCollator

IGNORE = -100


def world() -> tuple[int, int]:
    """(rank, world size) of torch.distributed, (0, 1) without it."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_sum(values: Sequence[float]) -> list[float]:
    """`values` summed over every process (float64; unchanged on one process)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if world()[1] > 1:
        dist.all_reduce(t)
    return t.tolist()


@contextlib.contextmanager
def project_attention(*models: Any) -> Iterator[None]:  # transformers models (or PEFT wrappers), or None
    """Inside the block the models run the project's packed attention (``attention.hf.NAME``); their own attention
    (what generation and the framework's padded passes use) is restored after it."""
    import attention.hf as ahf

    ahf.register()
    inner = [getattr(m, "module", m) for m in models if m is not None]
    saved = [m.config._attn_implementation for m in inner]
    try:
        for m in inner:
            if m.config._attn_implementation != ahf.NAME:
                m.set_attn_implementation(ahf.NAME)
        yield
    finally:
        for m, name in zip(inner, saved):
            if m.config._attn_implementation != name:
                m.set_attn_implementation(name)


def pack_sequences(prompts: Sequence[torch.Tensor], completions: Sequence[torch.Tensor]) -> dict:
    """One packed micro-batch (`PackedCollator`, one rank, no CP) of `prompt_i + completion_i` documents whose loss
    tokens are the completion tokens."""
    items = []
    for p, c in zip(prompts, completions):
        p, c = torch.as_tensor(p, dtype=torch.int64), torch.as_tensor(c, dtype=torch.int64)
        items.append({"input_ids": torch.cat([p, c]), "labels": torch.cat([torch.full_like(p, IGNORE), c])})
    return PackedCollator()(items)


def completion_logps(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Log-probabilities of the loss tokens of a packed micro-batch, in packed order ([K]: K = loss tokens), from
    TRL's fused LM head (``model(..., shift_labels=..., fused_lm_head=True)``: its temperature and logit scaling
    included) inside the batch's layout."""
    import attention.hf as ahf

    device = next(model.parameters()).device
    labels = batch["labels"].to(device)
    with ahf.cp_context(batch["layout"], model=model):
        out = model(
            input_ids=batch["input_ids"].to(device),
            position_ids=batch["position_ids"].to(device),
            shift_labels=labels,
            fused_lm_head=True,
            use_cache=False,
        )
    return out.log_probs[labels != IGNORE]


def loss_token_seq(batch: dict) -> torch.Tensor:
    """The micro-batch-local sequence index of every loss token, in packed order ([K])."""
    labels, seq = batch["labels"][0], batch["seq_ids"][0]
    return seq[labels != IGNORE]
