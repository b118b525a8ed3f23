"""Where a torchtitan loader is in its epoch: the sampler's position, and the loss-masked fillers of a short last
step, as one resume state that is the same on every rank.

A step of the plan may run fewer micro-batches (M') than the trainer pulls (M): the last step of an epoch, or of a
planning window, when the documents cannot fill M. After the M'-th micro-batch of such a step, M - M' filler items
follow. The state records the sampler's resume state (its rank fields dropped: the plan's position is the same on
every rank) and how many of those fillers were given; a state at the end of the epoch says so (`done`), so that it
resumes onto any topology (the sampler itself refuses a position inside a short step onto another one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from balancer.training.sampler import BalancedBatchSampler

FORMAT = "balancer.torchtitan_loader"
VERSION = 1


class LoaderState:
    """The iteration of a `BalancedDataLoader` over its sampler (module docstring)."""

    def __init__(self, sampler: BalancedBatchSampler, micro_batches: int) -> None:
        self.sampler, self.m = sampler, micro_batches
        self.fillers_due = 0  # fillers still to give in the current short step
        self.fillers_given = 0  # fillers given in the current short step
        self.done = False  # the epoch's last item was given
        self._resumed = False

    def items(self) -> Iterator[tuple[str, Optional[list]]]:
        """("batch", indices) or ("filler", None) to the end of the epoch (after a load: from the loaded place)."""
        if self.done:
            return
        it = self._iter()
        while True:
            while self.fillers_due:
                self.fillers_due -= 1
                self.fillers_given += 1
                yield "filler", None
            try:
                indices = next(it)
            except StopIteration:
                self.done = True
                return
            self.fillers_given = 0
            self.fillers_due = self._short_by(self.sampler.position)
            yield "batch", indices

    def _iter(self):
        if self._resumed:
            self._resumed = False
            return iter(self.sampler)  # the sampler continues from its loaded state
        self.fillers_due = self.fillers_given = 0
        return iter(self.sampler)

    def _short_by(self, position: int) -> int:
        """Fillers that complete the step when `position` micro-batches were yielded and the last one ends a short
        step (0 otherwise)."""
        if position == 0:
            return 0
        step, m = self.sampler.step_of(position - 1)
        ms = self.sampler.step_micro_batches(step)
        return self.m - ms if m == ms - 1 and ms < self.m else 0

    def next_epoch(self) -> None:
        self.sampler.set_epoch(self.sampler.epoch + 1)
        self.done = False
        self.fillers_due = self.fillers_given = 0

    def state_dict(self) -> dict:
        sampler = {k: v for k, v in self.sampler.state_dict().items() if k not in ("dp_rank", "rank")}
        done = self.done or (self.fillers_due == 0 and self.sampler.position >= len(self.sampler))
        return {"format": FORMAT, "format_version": VERSION, "sampler": sampler, "fillers": self.fillers_given,
                "done": done}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("format_version") != VERSION:
            raise ValueError(f"not a BalancedDataLoader state of format {FORMAT} version {VERSION}")
        fillers, done = state.get("fillers"), state.get("done")
        if isinstance(fillers, bool) or not isinstance(fillers, int) or fillers < 0 or not isinstance(done, bool):
            raise ValueError(f"BalancedDataLoader state: bad 'fillers' {fillers!r} or 'done' {done!r}")
        if done:
            self.sampler.set_epoch(state["sampler"]["epoch"])
            self.done, self.fillers_due, self.fillers_given = True, 0, 0
            return
        self.sampler.load_state_dict(state["sampler"])
        due = self._short_by(self.sampler.position)
        if fillers > due:
            raise ValueError(f"BalancedDataLoader state: {fillers} fillers given, the step has {due}")
        self.fillers_due, self.fillers_given = due - fillers, fillers
        self.done, self._resumed = False, True
