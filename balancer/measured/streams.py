"""`StreamSteps`: measured balance on a `balancer.streaming.BalancedStream` (docs/streaming.md).

    stream = BalancedStream(source, topology, cost, window_docs=4096)          # every rank
    monitor = balancer.BalanceMonitor(StreamSteps(stream), mode="adapt")
    for j, mb in enumerate(stream):
        with monitor.timer():
            forward_backward(mb)
        if (j + 1) % topology.micro_batches == 0:
            optimizer.step(); monitor.end_step()

This class is the step source (`balancer.measured.StepSource`) `BalanceMonitor` reads the stream's plan through (as
`BatchSteps` is for fixed batches), through the stream's public members only: the step being closed, every replica's
piece sizes in it (the stream's window plans are made from the gathered lengths with the same seed: the same on every
rank), its window and whether it is the window's last step, and the hook a fit reaches the windows by
(`BalancedStream.update_model`). Steps are numbered from the start of the pass; the stream keeps the plans of its last
few windows only.

A fit made after window `w` travels with the next gather (the first step of window `w + 1`) and plans windows `w + 2`..
The stream hands window `w + 2` to its planning thread half-way through window `w + 1`, so a fit that arrives later
(windows of one or two steps, a large `every`, CUDA timing's one step of delay on two-step windows) is an error naming
the window, never a silent change of which windows it plans. A new pass (`set_epoch` to another epoch) plans all its
windows with the latest model; the fit after a pass's last window arrives in the next pass (a pass's window count is not
known ahead) and plans that pass from its first window not handed to the planning thread yet (`plan_start`: the same on
every rank, which all read the fit at the same gather). The stream's `state_dict()` carries the monitor's state (under
"monitor"), and `load_state_dict` restores it: a resumed run plans what the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from balancer.planning.cost.model import CostModel
from balancer.planning.schedule import StepPlace
from balancer.training.indices import Span


class StreamSteps:
    """A step source for `BalanceMonitor` over `stream` (module docstring); with dynamic CP the monitor reads every
    pool rank's micro-batch and its group. Build it and the monitor before the stream's first `iter()` or
    `load_state_dict`."""

    def __init__(self, stream) -> None:
        from balancer.streaming.dataset import BalancedStream

        if not isinstance(stream, BalancedStream):
            raise TypeError(f"StreamSteps: stream must be a BalancedStream, got {type(stream).__name__}")
        if stream.monitor is not None:
            raise ValueError("this stream already has a BalanceMonitor attached")
        self.stream = stream
        self.topology, self.cost = stream.topology, stream.cost
        self.pool_rank, self.dp_rank = stream.pool_rank, stream.dp_rank

    @property
    def monitor(self) -> Any:
        return self.stream.monitor

    @monitor.setter
    def monitor(self, monitor: Any) -> None:  # BalanceMonitor attaches itself here; the stream saves and loads it
        self.stream.monitor = monitor

    # ---- what BalanceMonitor reads (balancer.measured.StepSource) ---------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.stream.epoch

    @property
    def position(self) -> int:
        """Micro-batches of this pass so far (`BalancedStream.position`)."""
        return self.stream.position

    def _plans(self) -> dict:
        return self.stream.window_plans

    @property
    def num_steps(self) -> int:
        """Steps of this pass up to the end of the last window entered."""
        plans = self._plans()
        if not plans:
            return 0
        first, seg = plans[max(plans)]
        return first + seg.num_steps

    def step_place(self, step: int) -> StepPlace:
        """(window, last step of it?, micro-batches every rank runs in it) of step `step` of this pass."""
        w, local = self.locate(step)
        seg = self._plans()[w][1]
        return StepPlace(w, local == seg.num_steps - 1, seg.step_micro_batches(local))

    def plan_start(self, epoch: int, window: int) -> tuple[int, int]:
        """(epoch, window) a fit meant for window `window` of pass `epoch` plans from: that window (a pass's window
        count is not known ahead: a fit never wraps into another pass), or when the stream has moved on to a new
        pass since the fit was made (it was for a window after the last one), that pass's first window not planned
        yet."""
        if epoch < self.stream.epoch:
            return self.stream.epoch, self.stream.next_unplanned_window
        return epoch, window

    def update_model(
        self, cost: CostModel, rank_speeds: Optional[Sequence[float]], first_window: int, *, epoch: int
    ) -> None:
        """A fit for windows `first_window`.. of pass `epoch` (the stream's): `BalancedStream.update_model`; a
        window already handed to the planning thread is a RuntimeError (every rank alike: the stream plans ahead at
        the same micro-batch)."""
        if epoch != self.stream.epoch:
            raise RuntimeError(f"StreamSteps: a fit for pass {epoch} while the stream is in pass {self.stream.epoch}")
        nxt = self.stream.next_unplanned_window
        if first_window < nxt:
            raise RuntimeError(
                f"BalanceMonitor: the refit for window {first_window} of the stream arrived after window {nxt - 1} "
                "was handed to its planning thread (it plans a window half-way through the one before): use "
                "windows of more steps (window_docs), every=1, or fewer prefetched micro-batches"
            )
        self.stream.update_model(cost, rank_speeds, first_window)

    def locate(self, step: int) -> tuple[int, int]:
        """(window, step within its segment) of step `step` of this pass (a window still kept)."""
        for w, (first, seg) in self._plans().items():
            if first <= step < first + seg.num_steps:
                return w, step - first
        raise ValueError(f"step {step} is not in the stream's last windows (kept: {sorted(self._plans())})")

    def steps(self, window: int) -> int:
        return self._plans()[window][1].num_steps

    def step_micro_batches(self, step: int) -> int:
        w, local = self.locate(step)
        return self._plans()[w][1].step_micro_batches(local)

    def piece_sizes(self, step: int, m: int, dp_rank: int | None = None, rank: int | None = None) -> tuple:
        """(token counts of `micro_batch`'s pieces, a dynamic plan's CP group (start, size) or None)."""
        w, local = self.locate(step)
        seg = self._plans()[w][1]
        if not self.topology.dynamic:
            return seg.piece_sizes(seg.mb_index(local, dp_rank, m), dp_rank)
        return seg.piece_sizes(seg.mb_index(local, rank, m), rank)

    def micro_batch(self, step: int, m: int, dp_rank: int | None = None, rank: int | None = None) -> list[Span]:
        """The pieces of micro-batch `m` of `step` on replica `dp_rank` (their sizes are what the monitor needs);
        dynamic CP: on pool rank `rank`, each piece carrying the micro-batch's CP group."""
        w, local = self.locate(step)
        seg = self._plans()[w][1]
        if not self.topology.dynamic:
            doc, start, end = seg.placements(seg.mb_index(local, dp_rank, m))
            return [Span(d, a, b) for d, a, b in zip(doc.tolist(), start.tolist(), end.tolist())]
        k = seg.mb_index(local, rank, m)
        group = seg.group(k, rank)
        doc, start, end = seg.placements(k)
        return [Span(d, a, b, group) for d, a, b in zip(doc.tolist(), start.tolist(), end.tolist())]
