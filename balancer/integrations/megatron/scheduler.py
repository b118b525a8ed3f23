"""`BalancedScheduler`: the project's plan as Megatron's training loop takes it.

Megatron's loop calls, once per optimizer step::

    forward_backward_func(forward_step_func=..., data_iterator=it, model=model, num_microbatches=n, ...)

and ``forward_step_func`` pulls one micro-batch from ``it`` per call. The scheduler hands out exactly that per
step: a `MegatronStep` whose ``data_iterator`` yields this rank's ``num_microbatches`` micro-batches of the step,
each a `megatron_batch` dict (this CP rank's share) with its ``packed_seq_params`` under the key of that name, the
CP group of the micro-batch (``cp_group``: the process group from ``groups``, dynamic CP included) and the step's
global loss-token count (``loss_tokens``, for a per-token loss normalised without an all-reduce). The plan comes
from a `BalancedBatchSampler` (deterministic, the same on every rank; its state is the scheduler's state).

It depends on no unreleased Megatron interface (the packing-scheduler classes of Megatron's development branches):
only ``num_microbatches`` and the data iterator, which every released schedule takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from balancer.integrations.megatron.batches import megatron_batch, packed_seq_params
from balancer.integrations.megatron.layouts import check_layout
from balancer.training.sampler import BalancedBatchSampler

if TYPE_CHECKING:
    from balancer.planning.topology import Topology


@dataclass
class MegatronStep:
    """One optimizer step: ``step`` (from the sampler's origin), ``num_microbatches`` (what Megatron's
    ``forward_backward_func`` is called with), ``data_iterator`` (yields that many batch dicts), ``loss_tokens``
    (global loss-token count of the step, all ranks), ``tokens`` (the step's real tokens, all ranks: the
    ``seqlen_sum`` of Megatron's FLOPs count)."""

    step: int
    num_microbatches: int
    data_iterator: Iterator[dict]
    loss_tokens: int
    tokens: int


class BalancedScheduler:
    """Per optimizer step, this rank's balanced micro-batches in Megatron's packed contract (module docstring).

    Args:
        sampler: the run's `BalancedBatchSampler` (its ``pool_rank`` is this rank's ``dp_rank * cp + cp_rank``;
            dynamic CP when its topology has ``cp_sizes``).
        tokens: the dataset the sampler's indices go to (a `ShardDataset`, or token-id rows).
        layout: ``"zigzag"`` (Megatron's per-document zigzag, padded to ``2 * cp``), ``"sequence"`` or ``"hybrid"``
            (no padding), as `megatron_batch`.
        groups: ``balancer.cp_groups(topology)`` (every CP group this rank may run on, keyed by ``(start, size)``);
            None: batches carry no process group (CP 1, or the caller sets it).
        with_params: attach ``packed_seq_params`` to every batch (needs megatron-core).
    """

    def __init__(
        self,
        sampler: BalancedBatchSampler,
        tokens,
        *,
        layout="zigzag",
        groups: Optional[dict] = None,
        with_params: bool = True,
        pad_token_id: int = 0,
    ) -> None:
        if not isinstance(sampler, BalancedBatchSampler):
            raise TypeError(f"sampler must be a balancer BalancedBatchSampler, got {type(sampler).__name__}")
        if groups is not None and not isinstance(groups, dict):
            raise TypeError(f"groups must be the dict balancer.cp_groups(topology) returns, got {type(groups)}")
        check_layout(layout)
        self.sampler, self.tokens, self.layout = sampler, tokens, layout
        self.groups, self.with_params, self.pad_token_id = groups, bool(with_params), int(pad_token_id)
        self._it: Optional[Iterator[list]] = None
        self._open: Optional[list] = None  # [handed out, due] of the last step's iterator

    @property
    def topology(self) -> Topology:
        return self.sampler.topology

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (the sampler's plan for it); the next `next_step` is its first step."""
        self.sampler.set_epoch(epoch)
        self._it, self._open = None, None

    def __iter__(self) -> Iterator[MegatronStep]:
        while (step := self.next_step()) is not None:
            yield step

    def next_step(self) -> Optional[MegatronStep]:
        """The next step of the epoch, or None at its end. The previous step's iterator must have been used up
        (Megatron pulls exactly ``num_microbatches``): otherwise ValueError, naming how many it handed out."""
        if self._open is not None and self._open[0] != self._open[1]:
            raise ValueError(
                f"the previous step's data_iterator handed out {self._open[0]} of its {self._open[1]} micro-batches: "
                "call forward_backward_func with num_microbatches=step.num_microbatches"
            )
        if self._it is None:
            self._it = iter(self.sampler)
        position = self.sampler.position
        if position >= len(self.sampler):
            return None
        step, m = self.sampler.step_of(position)
        if m != 0:
            raise ValueError(f"the sampler stands at micro-batch {m} of step {step}: resume at a step boundary")
        n = self.sampler.step_micro_batches(step)
        self._open = [0, n]
        loss_tokens, tokens = self.sampler.step_loss_tokens(step), self.sampler.step_tokens(step)
        return MegatronStep(step, n, self._micro_batches(n), loss_tokens, tokens)

    def _micro_batches(self, n: int) -> Iterator[dict]:
        for _ in range(n):
            assert self._it is not None and self._open is not None, "set by the step that hands these out"
            batch = self.batch(next(self._it))
            self._open[0] += 1  # counted when handed out: Megatron never resumes the iterator after the last one
            yield batch

    def batch(self, indices: list) -> dict:
        """The `megatron_batch` dict of one micro-batch's indices for this rank, with ``cp_group`` and (when
        ``with_params``) ``packed_seq_params``."""
        t = self.topology
        rank = self.sampler.pool_rank
        static = {} if t.dynamic else {"cp_rank": rank % t.cp, "cp_size": t.cp}
        out = megatron_batch(indices, self.tokens, layout=self.layout, pad_token_id=self.pad_token_id, **static)
        if not t.dynamic:
            out["cp_group_key"] = ((rank // t.cp) * t.cp, t.cp)
        group = self._process_group(out["cp_group_key"])
        out["cp_group"] = group
        if self.with_params:
            out["packed_seq_params"] = packed_seq_params(out, cp_group=group)
        return out

    def _process_group(self, key: tuple[int, int]) -> Any:
        if self.groups is None:
            if key[1] > 1:
                raise ValueError(f"a micro-batch runs on CP group {key}: pass groups=balancer.cp_groups(topology)")
            return None
        if key not in self.groups:
            raise ValueError(f"groups has no process group {key} (this rank's groups: {sorted(self.groups)})")
        return self.groups[key]

    def state_dict(self) -> dict:
        """The sampler's resume state (take it after a finished step)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it, self._open = iter(self.sampler), None
