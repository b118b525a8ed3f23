"""`BalanceMonitor`: measured balance for a training loop on a `BalancedBatchSampler`, and adapt mode's online refit.

    monitor = balancer.BalanceMonitor(sampler, mode="adapt")        # every rank, after building the sampler
    for batch in loader:
        with monitor.timer():                                        # this micro-batch's forward + backward only
            loss = model(**batch).loss; loss.backward()              # (under no_sync() but for the last one)
        if last_micro_batch_of_step:
            optimizer.step(); optimizer.zero_grad(); monitor.end_step()   # every rank: one small all-gather
    print(monitor.report())

Every rank times its own micro-batches (`record(seconds)` or `with monitor.timer():` - the wall clock on CPU; on
CUDA a pair of events read at the next `end_step`, so the stream is never stalled). `end_step()` all-gathers the
step's times over `group` (the default group; one float64 tensor of `2 * micro_batches + 14 + dp` numbers per rank, or
`every` steps at once) and adds them to the ledger, the same on every rank: a replica's micro-batch takes the
slowest of its ranks. After the last step of every window the first rank of the group refits the cost model (in
seconds) and the replica speeds from the evidence so far (balancer.measured.refit: outliers left out, a candidate
that predicts held-back micro-batches worse than the model in force refused); the coefficients travel with the next
gather, so every rank gets the same bits. `mode="adapt"` then plans the windows from two windows after the fitted one on
with them (the source's `update_model`; `plan_start` says where a fit starts): the next window was already planned ahead
in the background and may be in use by prefetching loaders, so it keeps its plan. The monitor reads its source
(`sampler`: a `BalancedBatchSampler`, `BatchSteps`, `StreamSteps` or any other) only through
`balancer.measured.StepSource`, and keeps which fit plans which window in a `WindowSchedule` (`schedule`).
`mode="shadow"` measures, fits and reports without changing any plan. A gather that fails (a rank died) or does not
finish within `timeout` seconds raises a RuntimeError naming the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch

from balancer.measured.arguments import check_monitor_options, checked_position, checked_seconds
from balancer.measured.ledger import Ledger, Model, slowest_of_groups
from balancer.measured.refit import refit
from balancer.measured.report import _errors, build_report, headline, measured_steps, timed_rows, token_room
from balancer.measured.resized import saved_units, without_replicas
from balancer.measured.settings import check_settings_agree, plan_settings
from balancer.measured.source import STEP_SOURCE_MEMBERS, StepSource
from balancer.planning.cost.fit import TERMS
from balancer.planning.cost.model import CostModel
from balancer.planning.schedule import StepPlace, WindowSchedule
from balancer.planning.topology import Topology

logger = logging.getLogger(__name__)

MODES = ("shadow", "adapt")
EVEN_SPEEDS = 1.1  # fitted speeds whose fastest / slowest is below this are planned as even (reported as fitted)
STATE_FORMAT = "balancer.monitor"
_HEAD = 4  # pool rank, dp rank, epoch, step


class BalanceMonitor:
    """Measured balance (and, in adapt mode, the online refit) for the training loop of `sampler` (any
    `balancer.measured.StepSource`); see the module docstring. `layout`: the collator's CP layout (what the refit's
    predictions assume); `warmup_steps`: steps after the monitor starts or resumes left out of the figures and the fit;
    `min_samples`: measured micro-batches before the first refit (default max(32, 4 * dp * micro_batches));
    `max_samples`: the refit's evidence (the most recent); `timeout`: seconds a gather may take; `every`: steps per
    gather; `cuda`: time with CUDA events (default: when CUDA is available)."""

    def __init__(
        self,
        sampler,
        mode: str = "shadow",
        group=None,
        *,
        layout: str = "zigzag",
        warmup_steps: int = 2,
        min_samples: Optional[int] = None,
        max_samples: int = 1024,
        timeout: float = 300.0,
        every: int = 1,
        cuda: Optional[bool] = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(sampler, StepSource):
            missing = [name for name in STEP_SOURCE_MEMBERS if not hasattr(sampler, name)]
            raise TypeError(f"BalanceMonitor: {type(sampler).__name__} is not a StepSource (it lacks {missing})")
        t = sampler.topology
        if sampler.monitor is not None:
            raise ValueError("this sampler already has a BalanceMonitor attached")
        for name, value, low in (
            ("warmup_steps", warmup_steps, 0),
            ("max_samples", max_samples, 8),
            ("every", every, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        check_monitor_options(timeout, min_samples, layout, cuda)  # measured.arguments
        self.sampler, self.mode, self.topology = sampler, mode, t
        self.layout, self.warmup_steps, self.timeout, self.every = layout, warmup_steps, float(timeout), every
        self.units = t.pool_size if t.dynamic else t.dp  # what is timed and given a speed: replicas, or pool ranks
        self.min_samples = max(32, 4 * self.units * t.micro_batches) if min_samples is None else int(min_samples)
        self.cuda = torch.cuda.is_available() if cuda is None else bool(cuda)
        self.group = group
        import torch.distributed as dist

        self._dist = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self._dist else 1
        self.rank = dist.get_rank(group) if self._dist else 0
        import scipy.optimize  # noqa: F401  (the refit's solver: imported here, not inside the first end_step)

        self.ledger = Ledger(self.units, max_samples, layout)
        speeds = getattr(t, "rank_speeds", None)  # the user's own speeds, if the topology has them
        self.models = [Model(sampler.cost, speeds, False, (0, 0), speeds)]
        self.schedule = WindowSchedule(t, sampler.cost)  # adapt mode: the fitted models, models[1:], one to one
        self.refits: list[dict] = []
        self._pending_fit: Optional[np.ndarray] = None  # first rank: a fit waiting to travel with the next gather
        self._epoch, self._step = sampler.epoch, sampler.position // t.micro_batches
        self._since_start = 0  # steps since start or resume (warm-up)
        self._current: dict[int, object] = {}
        self._closed: list = []  # (epoch, step, warm, [M] seconds or CUDA event pairs)
        self.cpu_seconds = 0.0  # CPU time of the calling thread in record / end_step (refits apart)
        self.refit_seconds = 0.0
        self._token_warned = False
        self._settings_checked = False  # measured.settings: checked equal on every rank at the first end_step
        self._tables: Optional[_Tables] = None  # log_figures' arrays of the ledger's rows
        sampler.monitor = self

    # ---- timing -----------------------------------------------------------------------------------------------
    def _sync_epoch(self) -> None:
        if self.sampler.epoch != self._epoch:
            self._epoch, self._step, self._current = self.sampler.epoch, 0, {}

    def record(
        self,
        seconds: Any,  # float seconds, or the (start, end) CUDA events of `timer`
        step: Optional[int] = None,
        micro_batch: Optional[int] = None,
        *,
        synced: bool = False,
    ) -> None:
        """This rank's measured seconds of one micro-batch (its forward + backward); `step` / `micro_batch` default
        to the next one of the current step. `synced=True`: the time includes the gradient reduction (DDP's last
        micro-batch), which waits for the slowest rank: kept apart, out of the fit, the errors and the step times."""
        c0 = time.thread_time()
        self._sync_epoch()
        if not isinstance(seconds, (torch.cuda.Event, tuple)):
            seconds = checked_seconds(seconds)  # refuses strings and bools too
        step, micro_batch = checked_position("step", step), checked_position("micro_batch", micro_batch)
        if step is not None and step != self._step:
            if self._current:
                raise ValueError(f"record: step {step} given while step {self._step} is not finished (end_step)")
            self._step = int(step)
        m = len(self._current) if micro_batch is None else int(micro_batch)
        if not 0 <= m < self.topology.micro_batches or m in self._current:
            raise ValueError(
                f"record: micro-batch {m} of step {self._step} is out of range or recorded twice "
                f"(micro_batches = {self.topology.micro_batches})"
            )
        self._current[m] = (seconds, bool(synced))
        self.cpu_seconds += time.thread_time() - c0

    @contextlib.contextmanager
    def timer(self, synced: bool = False) -> Iterator[None]:
        """Time the block as the next micro-batch (CUDA events when timing on CUDA, else `time.perf_counter`);
        `synced` as for `record`."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.record((start, end), synced=synced)
            return
        t0 = time.perf_counter()
        yield
        self.record(time.perf_counter() - t0, synced=synced)

    # ---- steps ------------------------------------------------------------------------------------------------
    def end_step(self) -> None:
        """Close the step (every rank, after the optimizer step); gathers every `every` steps (collective)."""
        c0, refits0 = time.thread_time(), self.refit_seconds
        self._sync_epoch()
        m = self.topology.micro_batches
        place = self.sampler.step_place(self._step)
        if not self._settings_checked:  # collective, once: every rank reaches its first end_step together
            check_settings_agree(plan_settings(self, self._plan_of(place)), self.group, self.world, self.timeout)
            self._settings_checked = True
        short = place.micro_batches
        if not (short < m and len(self._current) == short):  # a short last step (M' < M): closed, not measured
            if len(self._current) != m:
                raise ValueError(f"end_step: step {self._step} has {len(self._current)} recorded micro-batches of {m}")
            times = [self._current[i] for i in range(m)]
            self._closed.append(
                (self._epoch, self._step, self._since_start < self.warmup_steps, times, self._plan_of(place))
            )
        self._current, self._step, self._since_start = {}, self._step + 1, self._since_start + 1
        ready = len(self._closed) - (1 if self.cuda else 0)  # CUDA events are read one step later
        if ready >= self.every:
            self._gather(ready)
        self.cpu_seconds += time.thread_time() - c0 - (self.refit_seconds - refits0)  # the refit is counted apart

    def flush(self) -> None:
        """Gather every closed step now (collective; e.g. before the last `report()`)."""
        if self._closed:
            self._gather(len(self._closed))

    def _seconds(self, times) -> list[float]:
        out = []
        for t in times:
            if isinstance(t, tuple):
                t[1].synchronize()  # recorded at least a step ago: long done
                out.append(t[0].elapsed_time(t[1]) / 1000.0)
            else:
                out.append(t)
        return out

    def _payload(self, blocks) -> torch.Tensor:
        t = self.topology
        fit = self._pending_fit if self._pending_fit is not None else np.zeros(_fit_size(self.units))
        unit = self.sampler.pool_rank if t.dynamic else self.sampler.dp_rank
        rows = [
            [self.sampler.pool_rank, unit, b[0], b[1], *self._seconds([x[0] for x in b[3]])]
            + [float(x[1]) for x in b[3]]
            for b in blocks
        ]
        return torch.from_numpy(np.concatenate([fit, np.asarray(rows, dtype=np.float64).ravel()]))

    def _gather(self, k: int) -> None:
        blocks, self._closed = self._closed[:k], self._closed[k:]
        mine = self._payload(blocks)
        if self.world > 1:
            import torch.distributed as dist

            parts = [torch.empty_like(mine) for _ in range(self.world)]
            try:
                dist.all_gather(parts, mine, group=self.group, async_op=True).wait(
                    timeout=datetime.timedelta(seconds=self.timeout)
                )
            except RuntimeError as e:
                raise RuntimeError(
                    f"BalanceMonitor: the gather of step {blocks[-1][1]} (epoch {blocks[-1][0]}) failed on rank "
                    f"{self.rank}: a rank died or did not reach end_step within timeout={self.timeout:g} s ({e})"
                ) from None
            gathered = torch.stack(parts).numpy()
        else:
            gathered = mine.numpy()[None]
        self._pending_fit = None
        nf = _fit_size(self.units)
        fit, rows = gathered[0, :nf], gathered[:, nf:].reshape(self.world, k, -1)
        if fit[0]:
            self._apply(fit)
        for j, (epoch, step, warm, _, plan) in enumerate(blocks):
            if not np.all(rows[:, j, 2:4] == (epoch, step)):
                raise RuntimeError(f"BalanceMonitor: ranks disagree on the step gathered: {rows[:, j, 2:4].tolist()}")
            self._add_step(epoch, step, warm, rows[:, j], plan)

    def _plan_of(self, place: StepPlace) -> tuple:
        """(window, last step of it?, piece sizes [units][M], CP groups) of the step being closed (at `place`), read
        from the source's plan now (a gather may come after the source moved on to another epoch). Dynamic CP: the
        units are the pool ranks, each one's micro-batch in a slot its group's, and the groups [pool, M, 2] (start,
        size); static: None."""
        t, s = self.topology, self.sampler
        window, last = place.window, place.last
        slots = range(t.micro_batches)
        if not t.dynamic:
            sizes = [[s.piece_sizes(self._step, m, dp_rank=r)[0] for m in slots] for r in range(t.dp)]
            return window, last, sizes, None
        read = [[s.piece_sizes(self._step, m, rank=r) for m in slots] for r in range(t.pool_size)]
        groups = np.array([[group for _, group in per] for per in read], dtype=np.int64)
        return window, last, [[sizes for sizes, _ in per] for per in read], groups

    def _add_step(self, epoch: int, step: int, warm: bool, rows: np.ndarray, plan: tuple) -> None:
        t = self.topology
        window, last, sizes, groups = plan
        m = t.micro_batches
        seconds = np.zeros((self.units, m))
        timed, synced = rows[:, _HEAD : _HEAD + m], rows[:, _HEAD + m :].max(axis=0) > 0
        for row, mine in zip(rows, timed):  # a replica's micro-batch takes the slowest of its ranks (and stages)
            seconds[int(row[1])] = np.maximum(seconds[int(row[1])], mine)
        if groups is not None:  # dynamic CP: a group's micro-batch takes the slowest of its members
            seconds = slowest_of_groups(seconds, groups)
        own = ~synced if (~synced).any() else np.ones(m, dtype=bool)  # step times: the micro-batches' own compute
        model_id = self.model_id(epoch, window)
        info = {"epoch": epoch, "step": step, "window": window, "warm": warm}
        ranks = timed[:, own].sum(axis=1)
        cp = t.cp if groups is None else groups[:, :, 1]
        self.ledger.add_step(info, model_id, self.models[model_id], sizes, cp, seconds, ranks, synced, groups)
        if last and self.rank == 0:
            self._refit(epoch, window)

    # ---- refit ------------------------------------------------------------------------------------------------
    def _refit(self, epoch: int, window: int) -> None:
        c0 = time.thread_time()  # the whole refit (fit, bookkeeping, log) is refit_seconds, not cpu_seconds
        current = self.models[-1]
        speeds_ok = self.units > 1
        r = refit(
            self.ledger.evidence(), current.cost, current.speeds, self.units, layout=self.layout,
            current_in_seconds=current.in_seconds, min_samples=self.min_samples, speeds=speeds_ok,
        )  # fmt: skip
        first = self.sampler.plan_start(epoch, window + 2)  # the next window was planned ahead already
        record = {"epoch": epoch, "window": window, "first": list(first), "accepted": r.accepted, "reason": r.reason,
                  "samples": r.samples, "outliers": len(r.outliers), "score_current": r.score_current,
                  "score_candidate": r.score_candidate, "cpu_seconds": time.thread_time() - c0}  # fmt: skip
        logger.info("balance refit after window %d of epoch %d: %s", window, epoch, r.reason)
        self.refits.append(record)
        record["speed_noise"], record["speeds_supported"] = r.speed_noise, r.speeds_supported
        if r.accepted:
            assert r.cost is not None, "an accepted refit carries its cost model"
            self._pending_fit = _pack_fit(r.cost, r.speeds, first, self.units, r.speeds_supported)
        self.refit_seconds += time.thread_time() - c0

    def _apply(self, fit: np.ndarray) -> None:
        cost, speeds, first, supported = _unpack_fit(fit, self.models[0].cost, self.units)
        first = self.sampler.plan_start(*first)  # the same on every rank: the source may have moved on since the fit
        plan_speeds = speeds if (self.mode == "adapt" and _planner_takes_speeds()) else None
        if plan_speeds is not None and (not supported or max(plan_speeds) < EVEN_SPEEDS * min(plan_speeds)):
            plan_speeds = None  # within the evidence's noise or EVEN_SPEEDS: planned as even ranks
        if self.mode == "adapt" and speeds is not None and not _planner_takes_speeds() and self.rank == 0:
            logger.warning("the planner takes no rank_speeds: fitted speeds %s are reported, not planned", speeds)
        self.models.append(Model(cost, speeds, True, first, plan_speeds, len(self.ledger.steps)))
        bound = token_room(self.topology, speeds)
        if bound is not None and self.rank == 0 and not self._token_warned:  # once: every later fit says the same
            self._token_warned = True
            logger.warning(
                "BalanceMonitor: the fitted rank speeds %s ask the fastest replica for about %d tokens per step, but "
                "it holds %d: it gets less than its share of the work unless tokens_per_step is lowered to about %d "
                "(or max_tokens raised)", [round(x, 3) for x in speeds], *bound,
            )  # fmt: skip
        if self.mode != "adapt":
            return
        self.schedule.update(cost, plan_speeds, first[1], epoch=first[0])
        self.sampler.update_model(cost, plan_speeds, first[1], epoch=first[0])

    def model_id(self, epoch: int, window: int) -> int:
        """Index in `models` of the model window `window` of `epoch` is planned with (0: the source's own)."""
        return self.schedule.index(epoch, window)

    def model_for(self, epoch: int, window: int) -> tuple[Topology, CostModel]:
        """(topology, cost) window `window` of `epoch` is planned with."""
        return self.schedule.model(epoch, window)

    # ---- report and state ---------------------------------------------------------------------------------------
    def report(self) -> dict:
        """The measured balance so far (docs/measured-balance.md has every key); local, no communication."""
        return build_report(self)

    def log_figures(self) -> dict:
        """`report()`'s figures a training log shows (the same values), without rebuilding the whole report: the
        ledger's rows are copied into arrays once each (`report()` converts every step's at every call, which grows
        with the run: ~7 ms a call after 2,000 steps)."""
        if self._tables is None or not self._tables.follows(self.ledger):
            self._tables = _Tables(self.ledger)
        meas, pred, ranks, mb = self._tables.update(self.ledger)
        figures = headline(self, meas, pred, ranks, _errors(mb, self.models)[0])
        return {**figures, "refits_accepted": sum(r["accepted"] for r in self.refits)}

    def state_dict(self) -> dict:
        """Everything a resumed run needs to plan and refit as the uninterrupted one (JSON-able)."""
        ledger = self.ledger.state_dict()
        models = [m.to_dict() for m in self.models]
        for m in models:
            m["fresh_from"] = max(0, m["fresh_from"] - ledger["dropped"])
        return {
            "format": STATE_FORMAT,
            "mode": self.mode,
            "units": self.units,
            "epoch": self._epoch,
            "models": models,
            "refits": self.refits,
            "pending_fit": None if self._pending_fit is None else self._pending_fit.tolist(),
            "ledger": ledger,
            "cpu_seconds": self.cpu_seconds,
            "refit_seconds": self.refit_seconds,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; the step position comes from the sampler (`on_sampler_load`)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not a BalanceMonitor state (no 'format': 'balancer.monitor')")
        if state["mode"] != self.mode:
            raise ValueError(f"the monitor state is from mode={state['mode']!r}, this monitor has mode={self.mode!r}")
        saved = saved_units(state)
        if saved is not None and saved != self.units:  # another DP size (balancer.measured.resized)
            if self.rank == 0:
                logger.warning(
                    "BalanceMonitor: the state is from %d replicas, this run has %d: the fitted cost models are kept, "
                    "the replica speeds and the measured steps are not", saved, self.units,
                )  # fmt: skip
            state = without_replicas(state, self.models[0].to_dict())
        try:
            self.models = [Model.from_dict(m) for m in state["models"]]
            self.ledger.load_state_dict(state["ledger"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"monitor state: a malformed record ({e})") from None
        self.schedule = WindowSchedule(self.topology, self.sampler.cost)  # the source's own model, then the fits
        for m in self.models[1:] if self.mode == "adapt" else ():
            self.schedule.update(m.cost, m.plan_speeds, m.start[1], epoch=m.start[0])
        self.refits = list(state["refits"])
        fit = state["pending_fit"]
        self._pending_fit = None if fit is None else np.asarray(fit, dtype=np.float64)
        self.cpu_seconds, self.refit_seconds = float(state["cpu_seconds"]), float(state["refit_seconds"])

    def resume(self, state: dict) -> WindowSchedule:
        """The source is loading `state`: restore its "monitor" record (if any) and return a copy of the schedule of
        the models this monitor plans with (adapt mode's fits; the source's own model alone in shadow mode)."""
        if "monitor" in state:
            self.load_state_dict(state["monitor"])
        return self.schedule.copy()

    def restart(self) -> None:
        """A new run over the source from the start of a pass (a second `Trainer.train()`; collective: every rank
        calls it): the steps closed before are gathered, then steps count from 0 of the source's epoch again, with a
        warm-up again. The ledger, the models and the refits are kept. A run resumed from a state then calls
        `on_sampler_load` as usual."""
        self.flush()
        self._epoch, self._step = self.sampler.epoch, 0
        self._since_start, self._current = 0, {}

    def on_sampler_load(self) -> None:
        """The sampler loaded a state: count steps from its position on, warm-up again."""
        self._epoch, self._step = self.sampler.epoch, self.sampler.position // self.topology.micro_batches
        self._since_start, self._current, self._closed = 0, {}, []


class _Tables:
    """The ledger's rows as `report()` reads them, as arrays grown in place: per measured (not warm-up) step the
    replicas' measured and predicted times and the ranks' seconds; the micro-batch rows with a time, not left out."""

    def __init__(self, ledger: Ledger) -> None:
        self.steps, self.mb, self.n_steps, self.n_mb = ledger.steps, ledger.mb, 0, 0
        self.rows = [np.zeros((0, w)) for w in (ledger.dp, ledger.dp, 0, 9)]
        self.used = [0, 0, 0, 0]

    def follows(self, ledger: Ledger) -> bool:
        """The ledger still appends to the lists these arrays were read from (a loaded state replaces them)."""
        return ledger.steps is self.steps and ledger.mb is self.mb and self.n_steps <= len(ledger.steps)

    def _append(self, i: int, new: list, width: int) -> None:
        if not new:
            return
        block = np.array(new, dtype=np.float64).reshape(len(new), width)
        buf, used = self.rows[i], self.used[i]
        if buf.shape[1] != width or used + len(block) > len(buf):
            grown = np.zeros((max(64, 2 * (used + len(block))), width))
            if used:
                grown[:used] = buf[:used]
            self.rows[i] = buf = grown
        buf[used : used + len(block)] = block
        self.used[i] = used + len(block)

    def update(self, ledger: Ledger) -> tuple:
        """(measured [n, dp], predicted [n, dp], ranks [n, world], micro-batch rows [k, 9]) so far."""
        steps = measured_steps(ledger.steps[self.n_steps :])
        mb = timed_rows(ledger.mb[self.n_mb :])
        self.n_steps, self.n_mb = len(ledger.steps), len(ledger.mb)
        width = len(steps[0]["ranks"]) if steps else self.rows[2].shape[1]
        for i, (key, w) in enumerate((("measured", ledger.dp), ("predicted", ledger.dp), ("ranks", width))):
            self._append(i, [s[key] for s in steps], w)
        self._append(3, mb, 9)
        return tuple(buf[:used] for buf, used in zip(self.rows, self.used))


def _planner_takes_speeds() -> bool:
    from balancer.planning.topology import Topology

    return "rank_speeds" in {f.name for f in dataclasses.fields(Topology)}


def _fit_size(dp: int) -> int:
    return 1 + len(TERMS) + 1 + 2 + dp  # flag, coefficients, comm_overlap, (epoch, first window), speeds


def _pack_fit(cost: CostModel, speeds, first, dp: int, supported: bool = True) -> np.ndarray:
    """The fit as it travels; its flag: 1 no speeds, 2 speeds the evidence supports, 3 speeds within its noise."""
    s = np.ones(dp) if speeds is None else np.asarray(speeds)
    flag = 1.0 if speeds is None else (2.0 if supported else 3.0)
    coef = [getattr(cost, name) for name in TERMS]
    return np.array([flag, *coef, float(cost.comm_overlap), *first, *s], dtype=np.float64)


def _unpack_fit(fit: np.ndarray, like: CostModel, dp: int):
    n = len(TERMS)
    values: dict[str, Any] = dict(zip(TERMS, (float(x) for x in fit[1 : 1 + n])))
    cost = dataclasses.replace(like, **values, comm_overlap=bool(fit[1 + n]))
    first = (int(fit[2 + n]), int(fit[3 + n]))
    speeds = tuple(float(x) for x in fit[4 + n : 4 + n + dp]) if fit[0] in (2.0, 3.0) else None
    return cost, speeds, first, fit[0] == 2.0
