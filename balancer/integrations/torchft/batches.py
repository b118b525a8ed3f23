"""`FaultTolerantBatches`: balanced micro-batches for torchft's replica groups, every document of an epoch exactly
once in its committed steps, through failures, rejoins and slow replicas.

    batches = FaultTolerantBatches(lengths, topology, cost, replica_id="group-3")   # topology.dp: the most groups
    manager = Manager(pg=..., min_replica_size=..., replica_id="group-3", load_state_dict=..., state_dict=...)
    manager.register_state_dict_fn("batches", batches.load_state_dict, batches.state_dict)
    for epoch in range(E):
        batches.set_epoch(epoch)
        while True:
            manager.start_quorum()
            step = batches.next_step(manager)             # this group's micro-batches; None: the epoch is done
            if step is None:
                break
            for items in step:                            # [] when this group does not contribute to the step
                with batches.timer():                     # optional: measured speeds (adapt mode plans with them)
                    loss = token_loss(model(**collate(items)), num_tokens=batches.loss_tokens()); loss.backward()
            allreduce_gradients(manager)                  # sum of the contributors' gradients
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            optimizer.zero_grad()
            batches.end_step(committed)

The epoch's steps are those of the failure-free run: its windows planned on `topology` (`BalancedBatchSampler`'s
windows, the same pieces), a step's documents fixed by the window plan. Each step is planned again over the groups
that contribute to it (`plan_step`): one `manager.allreduce` of a small tensor tells every group which groups those
are (a group healing under async quorum has its tensor zeroed, as its gradients are: it gets no work), their data
positions (which must agree), speeds and `replica_id`s. Every contributor computes the same plan from the same
rows. A step that does not commit leaves the data state where it was: the same step is planned again, over the
groups of the next quorum. The data state (`state_dict`) is the committed position, the speeds and the current
window's plan from that position on (`WindowPieces`: a group that heals takes it instead of planning the window while
the others wait for its first step); it changes only in `end_step`, so the state torchft sends a healing group
during a step is the sender's at the start of the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

from balancer.integrations.torchft.exchange import Row, exchange
from balancer.integrations.torchft.monitored import MonitoredSteps, piece_lengths, plan_cost
from balancer.integrations.torchft.speeds import ReplicaSpeeds, plan_speeds
from balancer.integrations.torchft.step_plan import StepPieces, StepPlan, plan_step
from balancer.integrations.torchft.window_pieces import WindowPieces, window_key
from balancer.planning.cost.model import CostModel
from balancer.planning.schedule import StepPlace, check_seed
from balancer.planning.shuffle import num_windows
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES, check_topology_and_cost
from balancer.planning.window import check_window_docs, default_window_docs
from balancer.training.lengths import LengthsGuard, resolve_lengths, scan_lengths
from balancer.training.segments import EpochWindows

logger = logging.getLogger(__name__)

__all__ = ["FaultTolerantBatches", "STATE_FORMAT"]

STATE_FORMAT = "balancer.torchft"
MODES = ("shadow", "adapt")
_STEP_TAG = 0x66747374


@dataclasses.dataclass
class _Pending:
    """The step handed out by `next_step`, until `end_step`."""

    rows: Optional[list]  # the contributors' rows; None: torchft reported an error
    plan: Optional[StepPlan] = None
    mine: Optional[int] = None  # this group's place among the contributors (None: not one)

    @property
    def position(self):
        return self.rows[0].position if self.rows else None


class FaultTolerantBatches(MonitoredSteps):
    """This process's balanced micro-batches of each step under torchft (module docstring).

    `lengths`, `topology`, `cost`, `seed`, `window_docs`, `overflow` as for `BalancedBatchSampler`; `topology.dp` is
    the largest number of replica groups, `topology.micro_batches` each group's micro-batches in the failure-free
    run (static CP only; no `rank_speeds`: speeds are measured). `replica_id`: the id given to torchft's `Manager`.
    `mode`: "shadow" measures speeds and reports them, "adapt" also plans every step with them. `stall_seconds`:
    a group's measured step compute beyond this is reported as a stall (`report()`). `cp_rank`: this process's
    rank in its replica group (the monitor's `pool_rank`). A `BalanceMonitor` attaches to it (`monitored`): its
    `topology` is the monitor's view of this group, `run_topology` the failure-free run's."""

    def __init__(
        self,
        lengths,
        topology: Topology,
        cost: CostModel,
        *,
        replica_id: str,
        seed: int = 0,
        window_docs: Optional[int] = None,
        overflow: str = "error",
        mode: str = "shadow",
        stall_seconds: Optional[float] = None,
        cp_rank: int = 0,
    ) -> None:
        _check_args(topology, cost, replica_id, seed, overflow, mode)
        self.lengths, _ = resolve_lengths(lengths, None)
        summary = scan_lengths(self.lengths)
        n = summary.num_docs
        if overflow == "error" and summary.longest > topology.micro_batch_tokens:
            raise ValueError(
                f"document {summary.longest_doc} has {summary.longest} tokens, more than a micro-batch holds: "
                f"max_tokens*cp = {topology.micro_batch_tokens}; raise max_tokens or cp, or pass overflow='split'"
            )
        if window_docs is None:
            self.window_docs = default_window_docs(n, summary.total_tokens, topology)
        else:
            self.window_docs = n if window_docs >= n else check_window_docs(window_docs, topology, n)
        if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < topology.cp:
            raise ValueError(f"cp_rank must be an integer in 0 .. topology.cp - 1 = {topology.cp - 1}, got {cp_rank!r}")
        self.run_topology, self.cost, self.replica_id, self.cp_rank = topology, cost, replica_id, cp_rank
        self.seed, self.overflow, self.mode = int(seed), overflow, mode
        self.fingerprint = summary.fingerprint
        self._guard = LengthsGuard(self.lengths, summary.fingerprint)
        self.speeds = ReplicaSpeeds(stall_seconds=stall_seconds)
        self.epoch, self.window, self.step, self.committed_steps, self.epoch_steps = 0, 0, 0, 0, 0
        self._origin, self._epoch_window_docs = 0, self.window_docs
        self._history: list = []
        self._windows: Optional[EpochWindows] = None
        self._seg: Optional[tuple[str, Any]] = None  # (window key, its plan segment) once this group planned it
        self._shared: Optional[WindowPieces] = None  # the window's plan received with a data state (a rejoin)
        self._plan_cache: Optional[tuple[str, int, dict]] = None  # (key, step, the plan's state) last sent
        self._pending: Optional[_Pending] = None
        self._seconds: list[float] = []  # this process's measured micro-batches in the step handed out
        self._last: Optional[tuple[float, float]] = None  # (seconds, predicted) of its last committed step
        self.stale = False
        self.log: list[dict] = []  # per step handed out: contributors, micro-batches, predicted imbalance
        self._init_monitored()

    # ---- the epoch's windows ----------------------------------------------------------------------------------
    @property
    def windows(self) -> EpochWindows:
        if self._windows is None:
            self._windows = EpochWindows(
                self.lengths,
                self.run_topology,
                self.cost,
                seed=self.seed,
                epoch=self.epoch,
                overflow=self.overflow,
                window_docs=self._epoch_window_docs,
                origin=self._origin,
                history=self._history,
                guard=self._guard,
            )
        return self._windows

    def _done(self) -> bool:
        return self.window >= self.windows.count

    def _key(self) -> str:
        return window_key(self.epoch, self.window, self._epoch_window_docs, self._digest(), self.run_topology,
                          self.cost)  # fmt: skip

    def pieces(self) -> StepPieces:
        """The pieces of the step at this group's data position (the failure-free run's step)."""
        if 2 * self.step >= self._window_steps():
            self.windows.plan_ahead(self.window + 1)
        key = self._key()
        if self._shared is not None and self._shared.holds(key, self.step):
            return self._shared.pieces(self.step)
        seg = self.windows.segment(self.window)
        self._seg = (key, seg)
        return _segment_step(seg, self.step)

    def _window_steps(self) -> int:
        """The current window's step count (from the received plan when it is the window's: no planning)."""
        if self._shared is not None and self._shared.key == self._key():
            return self._shared.steps
        return self.windows.steps(self.window)

    def _plan_state(self) -> Optional[dict]:
        """The current window's steps from this one on (None past the epoch's last): the same on every group at
        the same position, whether it planned the window or received its plan; kept until the position moves."""
        if self._done():
            return None
        key, cached = self._key(), self._plan_cache
        if cached is not None and cached[:2] == (key, self.step):
            return cached[2]
        shared = self._shared
        if shared is not None and shared.holds(key, self.step):
            steps, count = [shared.pieces(k) for k in range(self.step, shared.steps)], shared.steps
        else:
            seg = self.windows.segment(self.window)
            self._seg = (key, seg)
            steps, count = [_segment_step(seg, k) for k in range(self.step, seg.num_steps)], seg.num_steps
        state = WindowPieces.of_steps(key, self.step, steps, count).to_state()
        self._plan_cache = (key, self.step, state)
        return state

    def _digest(self) -> int:
        """48-bit digest of the re-planned window's history (0 past it or without one): groups compare it."""
        if not self._history or self.window != self._origin:
            return 0
        text = json.dumps([[h["topology"].to_dict(), h["cost"].to_dict(), h["steps"]] for h in self._history])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")

    # ---- the step ---------------------------------------------------------------------------------------------
    def next_step(self, manager: Any) -> Optional[list]:
        """This process's micro-batches of the next step (lists of sampler indices; [] when this group does not
        contribute); None once every step of the epoch is committed. Call after `manager.start_quorum()` on every
        process of every replica group of the quorum (it runs one `manager.allreduce`)."""
        if self._pending is not None:
            raise RuntimeError("next_step: the step handed out before has not been closed with end_step(committed)")
        slot = manager.participating_rank()
        row = self._row(slot) if slot is not None and manager.is_participating() else None
        rows = exchange(manager, row, self.run_topology.dp)
        self._seconds = []
        self._pending = _Pending(rows)
        if not rows:
            return []
        _check_agree(rows)
        if rows[0].done:
            self._pending = None
            return None
        mine = next((i for i, r in enumerate(rows) if row is not None and r.slot == row.slot), None)
        if mine is None:
            return []
        speeds = plan_speeds([r.speed for r in rows]) if self.mode == "adapt" else None
        seed = int(np.random.SeedSequence([_STEP_TAG, self.seed, *rows[0].position[:3]]).generate_state(1)[0])
        cost = plan_cost(rows, self.cost)  # a monitor's fit proposed by the first contributor, or the run's own
        plan = plan_step(self.pieces(), self.run_topology, cost, len(rows), speeds, seed)
        self._pending = _Pending(rows, plan, mine)
        self.log.append(
            {
                "committed_steps": self.committed_steps,
                "position": list(rows[0].position[:3]),
                "contributors": [r.replica_id for r in rows],
                "speeds": speeds,
                "fitted": cost is not self.cost,
                "micro_batches": plan.micro_batches,
                "imbalance": plan.imbalance,
                "times": plan.times.tolist(),
                "costs": plan.costs.tolist(),
            }
        )
        return plan.items[mine]

    def _row(self, slot: int) -> Row:
        done = self._done()
        pieces = None if done else self.pieces()
        own = self.speeds.speed(self.replica_id) if self.mode == "adapt" else None
        seconds, predicted = self._last if self._last is not None else (0.0, 0.0)
        return Row(
            slot,
            self.replica_id,
            self.epoch,
            self.window,
            self.step,
            self._digest(),
            done,
            0 if pieces is None else pieces.loss_tokens,  # None: done
            0 if pieces is None else pieces.tokens,
            own or 0.0,
            seconds,
            predicted,
            self.fit_row(),
        )

    def step_plan(self) -> Optional[tuple[list[str], list]]:
        """The step handed out as every contributor planned it: (their replica_ids in plan order, each one's
        micro-batches); None when this group does not contribute (for logs and checks)."""
        p = self._pending
        if p is None or p.plan is None or p.rows is None:
            return None
        return [r.replica_id for r in p.rows], p.plan.items

    def loss_tokens(self) -> int:
        """The global loss-token count of the step handed out (all its pieces' `tokens - 1`, over the contributing
        groups: the failure-free run's step count); 0 when no group contributes."""
        if self._pending is None:
            raise RuntimeError("loss_tokens: call next_step first")
        return self._pending.rows[0].loss_tokens if self._pending.rows else 0

    def record(self, seconds: float) -> None:
        """This process's measured seconds of one micro-batch's forward + backward (summed over the step)."""
        seconds = float(seconds)
        if not (np.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"record: seconds must be a finite number >= 0, got {seconds!r}")
        self._seconds.append(seconds)

    @contextlib.contextmanager
    def timer(self) -> Iterator[None]:
        """Time the block (wall clock) as one micro-batch of this step (`record`)."""
        t0 = time.perf_counter()
        yield
        self.record(time.perf_counter() - t0)

    def end_step(self, committed: bool) -> None:
        """Close the step with `manager.should_commit()`: committed, its documents are consumed; not, they are
        planned again in the next step."""
        p, self._pending = self._pending, None
        if p is None:
            raise RuntimeError("end_step: no step handed out (next_step returned None or was not called)")
        if not committed or not p.rows:
            return
        here = (self.epoch, self.window, self.step, self._digest())
        if here != p.position:
            self.stale = True
            logger.error(
                "replica %s: data position %s differs from the contributors' %s after a committed step: "
                "this group's data state is stale (load the state before its next step)",
                self.replica_id,
                here,
                p.position,
            )
            return
        for r in p.rows:
            self.speeds.observe(self.committed_steps, r.replica_id, r.predicted, r.seconds)
        self.speeds.members_at(self.committed_steps, [r.replica_id for r in p.rows])
        items = [] if p.mine is None or p.plan is None else p.plan.items[p.mine]
        self._last = self._measured_step(items)
        last = self.step == self._window_steps() - 1
        self.measure(StepPlace(self.window, last, self.topology.micro_batches), items, self._seconds)
        self._advance()

    def _measured_step(self, items: list) -> Optional[tuple[float, float]]:
        """(seconds, predicted cost units per CP rank under the run's own `cost`) of this group's micro-batches of
        the step (None: it had none or timed none): the same units whichever model planned the step."""
        seconds = float(sum(self._seconds))
        if not items or seconds <= 0:
            return None
        units = sum(self.cost.micro_batch_cost(piece_lengths(mb, self.lengths)) for mb in items)
        return seconds, units / self.run_topology.cp

    def _advance(self) -> None:
        self.step += 1
        self.committed_steps += 1
        self.epoch_steps += 1
        if self.step >= self._window_steps():
            self.window, self.step = self.window + 1, 0
            self._seg = self._shared = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (setting the epoch the state is in keeps its position)."""
        epoch = int(epoch)
        if epoch == self.epoch:
            return
        self.epoch, self.window, self.step, self.epoch_steps = epoch, 0, 0, 0
        self._origin, self._history, self._epoch_window_docs = 0, [], self.window_docs
        self._windows, self._seg, self._shared = None, None, None

    def report(self) -> dict:
        """Speeds per replica_id, slowdowns, stalls, departures and arrivals (`ReplicaSpeeds.report`), the
        committed steps and this group's stale flag."""
        return {"committed_steps": self.committed_steps, "stale": self.stale, **self.speeds.report()}

    def _received_plan(self, plan: Optional[dict]) -> Optional[WindowPieces]:
        """The window's plan a data state carries, when it is this group's window from this step on (else None:
        this group plans the window itself)."""
        shared = WindowPieces.from_state(plan, self.lengths)
        if shared is None or not shared.holds(self._key(), self.step):
            return None
        self._guard.check(f"window {self.window} of epoch {self.epoch} (received plan)")
        return shared

    # ---- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The committed data position, the speeds and the current window's plan from the position on, planned now
        if it is not yet (plain Python values: torchft's transfer and checkpoints take it as is)."""
        here = [{"topology": self.run_topology.to_dict(), "cost": self.cost.to_dict(), "steps": None}]
        past = self._history if self.window == self._origin else []
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "window": self.window,
            "step": self.step,
            "committed_steps": self.committed_steps,
            "epoch_steps": self.epoch_steps,
            "window_docs": self._epoch_window_docs,
            "seed": self.seed,
            "overflow": self.overflow,
            "fingerprint": self.fingerprint,
            "num_docs": int(len(self.lengths)),
            "segments": [
                {"topology": h["topology"].to_dict(), "cost": h["cost"].to_dict(), "steps": h["steps"]} for h in past
            ]
            + here,
            "speeds": self.speeds.state_dict(),
            "fit": self.fit_state(),
            "plan": self._plan_state(),
            **({} if self.monitor is None else {"monitor": self.monitor.state_dict()}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: exactly, also onto another topology (`topology.dp`, micro_batches, ...): the
        window's documents not yet consumed are planned again for this one, nothing lost or repeated."""
        _check_state(state, self)
        segs = state["segments"]
        history = [
            {"topology": Topology.from_dict(s["topology"]), "cost": CostModel.from_dict(s["cost"]), "steps": s["steps"]}
            for s in segs[:-1]
        ]
        last_topo, last_cost = Topology.from_dict(segs[-1]["topology"]), CostModel.from_dict(segs[-1]["cost"])
        window, step = int(state["window"]), int(state["step"])
        if (last_topo, last_cost) != (self.run_topology, self.cost):
            history.append({"topology": last_topo, "cost": last_cost, "steps": step})
            step = 0
        self.epoch, self.window, self.step = int(state["epoch"]), window, step
        self.committed_steps = int(state["committed_steps"])
        self._epoch_window_docs = int(state["window_docs"])
        self._origin, self._history, self._windows, self._seg = window, history, None, None
        if window >= num_windows(len(self.lengths), self._epoch_window_docs):  # a state at the epoch's end
            self._origin, self._history = 0, []
        self._shared = self._received_plan(state.get("plan"))
        if window < self.windows.count and step > self._window_steps():
            raise ValueError(f"the state's step {step} is past window {window}'s {self._window_steps()} steps")
        if window < self.windows.count and step == self._window_steps():
            self.window, self.step, self._shared = window + 1, 0, None
        self.speeds.load_state_dict(state["speeds"])
        self.epoch_steps = int(state["epoch_steps"])
        self.load_fit_state(state["fit"])
        self.stale = False
        if self.monitor is not None:
            self.monitor.resume(state)
            self.monitor.on_sampler_load()


def _segment_step(seg: Any, step: int) -> StepPieces:
    """Step `step`'s pieces in a window's plan segment."""
    sl = seg.step_slice(step)
    assert seg.full is not None, "EpochWindows._build sets each placement's document length"
    return StepPieces(seg.doc[sl], seg.start[sl], seg.end[sl], seg.full[sl], seg.step_micro_batches(step))


def _check_args(topology, cost, replica_id, seed, overflow, mode) -> None:
    check_topology_and_cost(topology, cost)
    if topology.dynamic:
        raise ValueError("FaultTolerantBatches: topology.cp_sizes (dynamic CP) is not supported; use a static cp")
    if topology.rank_speeds is not None:
        raise ValueError("FaultTolerantBatches: topology.rank_speeds must be None (speeds are measured per replica_id)")
    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"replica_id must be a non-empty string (the Manager's replica_id), got {replica_id!r}")
    check_seed(seed)
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _check_agree(rows: list) -> None:
    if any(r.position != rows[0].position for r in rows):
        seen = {r.replica_id: list(r.position[:3]) for r in rows}
        raise RuntimeError(
            f"the contributing replica groups disagree on the data position (epoch, window, step): "
            f"{seen}; a group's data state was not restored (register batches.state_dict with the "
            "Manager and load checkpoints into every group)"
        )
    if len({r.replica_id for r in rows}) != len(rows):
        raise RuntimeError(f"two contributing replica groups share a replica_id: {[r.replica_id for r in rows]}")


def _check_state(state, batches: FaultTolerantBatches) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a FaultTolerantBatches state (no 'format': {STATE_FORMAT!r})")
    missing = [k for k in ("epoch_steps", "fit", "speeds", "segments") if k not in state]
    if missing:
        raise ValueError(f"the FaultTolerantBatches state lacks {missing} (saved by an older version)")
    if state["fingerprint"] != batches.fingerprint or state["num_docs"] != len(batches.lengths):
        raise ValueError(
            f"the state is from another data set: {state['num_docs']} documents, fingerprint "
            f"{state['fingerprint']}; these lengths have {len(batches.lengths)}, {batches.fingerprint}"
        )
    for name in ("seed", "overflow"):
        if state[name] != getattr(batches, name):
            raise ValueError(f"the state is from {name}={state[name]!r}, these batches have {getattr(batches, name)!r}")
