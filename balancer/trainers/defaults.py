"""The topology a balanced Trainer uses when it is given none: the common data-parallel case in one line.

- `dp` = the Trainer's world size (`TrainingArguments.world_size`: the processes torchrun / accelerate started);
  CP off (`cp = 1`), no pipeline;
- `micro_batches` = `TrainingArguments.gradient_accumulation_steps` (an optimizer step is that many micro-batches
  on every rank, as in the stock Trainer);
- the token budget of a micro-batch, `max_tokens` = `per_device_train_batch_size` x a length `L`: with TRL's
  `SFTConfig`, `L` = its `max_length` (a packed TRL row; TRL's truncation to it is turned off, a longer document
  follows `overflow`); for the plain Trainer, `L` = the longest document of the training (and eval) data, so a
  micro-batch never needs more memory than the stock Trainer's largest padded batch of
  `per_device_train_batch_size` rows;
- `tokens_per_step` = the stock Trainer's global batch in documents (`per_device_train_batch_size` x
  `gradient_accumulation_steps` x world size) times the data's mean document length, rounded, capped at the
  capacity: a step holds about as many tokens, hence documents, as a stock step does.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Optional

import numpy as np

from balancer.planning.topology import Topology

if TYPE_CHECKING:
    from transformers import TrainingArguments

logger = logging.getLogger(__name__)


def default_topology(
    args: TrainingArguments, lengths: np.ndarray, max_length: Optional[int] = None, eval_longest: int = 0
) -> Topology:
    """The `Topology` of the module docstring from `args` (`TrainingArguments` / `SFTConfig`) and the training
    data's document `lengths`; `max_length`: the length `L` (None: the longest document of the training data and,
    `eval_longest`, of the eval data, so that every eval document fits too). Logged once."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        raise ValueError("the training dataset is empty: no topology can be derived from it")
    world = max(1, int(args.world_size))
    m = max(1, int(args.gradient_accumulation_steps))
    bs = max(1, int(args.per_device_train_batch_size))
    if max_length is not None:
        if isinstance(max_length, bool) or int(max_length) != max_length or max_length < 1:
            raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
        length, source = int(max_length), f"SFTConfig.max_length={int(max_length)}"
    else:
        length = max(int(lengths.max()), int(eval_longest))
        source = f"the longest training or eval document ({length} tokens)"
    max_tokens = bs * length
    capacity = world * m * max_tokens
    tokens_per_step = min(capacity, max(1, round(bs * m * world * float(lengths.mean()))))
    topo = Topology(dp=world, cp=1, micro_batches=m, max_tokens=max_tokens, tokens_per_step=tokens_per_step)
    logger.info(
        "no topology given: %s (dp = world size %d, micro_batches = gradient_accumulation_steps %d, max_tokens = "
        "per_device_train_batch_size %d x %s, tokens_per_step = %d x %d x %d documents x mean length %.1f; "
        "%d optimizer steps per epoch expected)",
        topo,
        world,
        m,
        bs,
        source,
        bs,
        m,
        world,
        float(lengths.mean()),
        math.ceil(float(lengths.sum()) / tokens_per_step),
    )
    warn_short_step(topo, lengths, world, m, bs)
    return topo


def warn_short_step(topo: Topology, lengths: np.ndarray, world: int, m: int, bs: int) -> None:
    """Warn (once, naming the document and the setting) when the derived step holds fewer tokens than the longest
    training document: every step holding that document is that document alone on one replica (the other replicas
    idle for it), and the step budget is not kept."""
    longest = int(np.argmax(lengths))
    if int(lengths[longest]) <= topo.step_tokens:
        return
    message = (
        f"the default topology's step holds {topo.tokens_per_step:,} tokens (tokens_per_step = "
        f"per_device_train_batch_size {bs} x gradient_accumulation_steps {m} x world size {world} documents x the "
        f"mean length), fewer than training document {longest} ({int(lengths[longest]):,} tokens): its steps are "
        "that document alone and the other replicas idle for it; raise gradient_accumulation_steps or "
        "per_device_train_batch_size, or pass topology=Topology(..., tokens_per_step=...)"
    )
    logger.warning(message)
    warnings.warn(message, UserWarning, stacklevel=3)
