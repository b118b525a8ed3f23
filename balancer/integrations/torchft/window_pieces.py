"""The pieces of the current window's steps not yet committed, as they travel in the data state: a replica group
that rejoins takes the sender's plan of the window (every contributor's plan: they all plan it from the same
inputs) instead of planning the window again before its first step, while the other groups wait for it.

The plan is used only where its `key` (epoch, window, window_docs, the re-planned window's history digest, the
run's topology and cost) is the receiver's own; otherwise the receiver plans the window itself, as before.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import numpy as np

from balancer.integrations.torchft.step_plan import StepPieces

__all__ = ["WindowPieces"]


@dataclasses.dataclass(frozen=True)
class WindowPieces:
    """Steps `first` .. `steps - 1` of one window: step `first + i`'s pieces are `doc/start/end/full[ptr[i]:ptr[i +
    1]]`, run on `micro_batches[i]` micro-batches per replica in the failure-free run."""

    key: str
    first: int
    steps: int
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    full: np.ndarray
    ptr: np.ndarray
    micro_batches: np.ndarray

    @classmethod
    def of_steps(cls, key: str, first: int, steps: list[StepPieces], full_steps: int) -> WindowPieces:
        """The window's steps `first` .. from each one's `StepPieces` (`full_steps`: the window's step count)."""

        def cat(name: str) -> np.ndarray:
            parts = [np.asarray(getattr(s, name), dtype=np.int64) for s in steps]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        ptr = np.concatenate([[0], np.cumsum([len(s.doc) for s in steps], dtype=np.int64)]).astype(np.int64)
        mbs = np.asarray([s.micro_batches for s in steps], dtype=np.int64)
        return cls(key, int(first), int(full_steps), cat("doc"), cat("start"), cat("end"), cat("full"), ptr, mbs)

    def holds(self, key: str, step: int) -> bool:
        return key == self.key and self.first <= step < self.steps

    def pieces(self, step: int) -> StepPieces:
        """Step `step`'s pieces (a step this holds: `holds`)."""
        i = step - self.first
        sl = slice(int(self.ptr[i]), int(self.ptr[i + 1]))
        return StepPieces(self.doc[sl], self.start[sl], self.end[sl], self.full[sl], int(self.micro_batches[i]))

    def to_state(self) -> dict:
        """Plain Python values (no `full`: the receiver reads its own lengths)."""
        return {
            "key": self.key, "first": self.first, "steps": self.steps, "doc": self.doc.tolist(),
            "start": self.start.tolist(), "end": self.end.tolist(), "ptr": self.ptr.tolist(),
            "micro_batches": self.micro_batches.tolist(),
        }  # fmt: skip

    @classmethod
    def from_state(cls, state: Any, lengths: np.ndarray) -> Optional[WindowPieces]:
        """The pieces of a `to_state()` (None for None); ValueError naming what is inconsistent."""
        if state is None:
            return None
        try:
            doc, start, end, ptr, mbs = (np.asarray(state[k], dtype=np.int64)
                                         for k in ("doc", "start", "end", "ptr", "micro_batches"))  # fmt: skip
            key, first, steps = str(state["key"]), int(state["first"]), int(state["steps"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the data state's 'plan' is malformed: {e!r}") from None
        n = len(doc)
        ok = len(start) == len(end) == n and len(ptr) == len(mbs) + 1 == steps - first + 1 and first >= 0
        ok = ok and (n == 0 or (doc.min() >= 0 and doc.max() < len(lengths)))
        if not ok or ptr[0] != 0 or ptr[-1] != n or np.any(np.diff(ptr) < 0):
            raise ValueError("the data state's 'plan' is inconsistent (piece arrays, step pointers, step count)")
        full = np.asarray(lengths[doc], dtype=np.int64)
        if n and (np.any(start < 0) or np.any(end <= start) or np.any(end > full)):
            raise ValueError("the data state's 'plan' has a piece outside its document")
        return cls(key, first, steps, doc, start, end, full, ptr, mbs)


def window_key(epoch: int, window: int, window_docs: int, digest: int, topology: Any, cost: Any) -> str:
    """What a window's plan depends on beyond the lengths and the seed (checked with the state)."""
    return json.dumps([epoch, window, window_docs, digest, topology.to_dict(), cost.to_dict()], sort_keys=True)
