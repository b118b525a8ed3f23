"""Measured balance inside the Hugging Face trainers (`BalancedTrainer(..., balance_mode=...)`): a
`balancer.measured.BalanceMonitor` on the trainer's sampler, every micro-batch's forward + backward timed (the
stock `training_step`), `end_step` after every optimizer step, and the report's figures logged with the Trainer's
own logs under `balance/`.

`balance_mode`: "shadow" (the default: measure, fit and report, never change a plan), "adapt" (plan the windows
not yet planned with the refitted cost model and replica speeds; pool-rank speeds with dynamic CP) or "off". With
several processes the last micro-batch of a step runs the gradient all-reduce inside its backward pass (DDP): its
time waits for the slowest rank, so it is recorded apart (`synced`) and left out of the fit, the errors and the
step times.

With gradient accumulation 1 on several processes every micro-batch is such a synced one: the monitor then holds
no micro-batch's own compute, only times that include the wait for the slowest rank (a balanced-looking figure
whatever the balance). The trainer then logs no measured figure (only the plan's predicted imbalance) and warns
once, naming `gradient_accumulation_steps`; "adapt" says once that it cannot adapt (no evidence, or an epoch planned
as one window).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from balancer.measured.monitor import MODES, BalanceMonitor
from balancer.trainers.host import TrainerHost

logger = logging.getLogger(__name__)

BALANCE_MODES = (*MODES, "off")
MEASURED = (
    "measured_imbalance",
    "prediction_error_median",
    "prediction_error_p90",
    "fresh_error_median",
    "fresh_error_p90",
    "idle_fraction",
    "mean_step_seconds",
)  # fmt: skip  (figures of measured times)
LOGGED = ("measured_imbalance", "predicted_imbalance", "prediction_error_median", "prediction_error_p90",
          "fresh_error_median", "fresh_error_p90", "idle_fraction", "mean_step_seconds")  # fmt: skip


class _EndStep(TrainerCallback):
    """`monitor.end_step()` after every optimizer step (every rank: the monitor's one collective)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        monitor = self.trainer.balance_monitor
        if monitor is not None:
            monitor.end_step()


class MeasuredBalanceMixin(TrainerHost):
    """The monitor parts of the balanced trainers (module docstring); sits between the balanced mixin and the
    stock Trainer in the class order, so `training_step` here times the stock step alone."""

    def __init__(self, *args, balance_mode: str | None = None, **kwargs) -> None:
        if balance_mode is not None and balance_mode not in BALANCE_MODES:
            raise ValueError(f"balance_mode must be one of {BALANCE_MODES}, got {balance_mode!r}")
        self.balance_mode = balance_mode
        self.balance_monitor: BalanceMonitor | None = None
        super().__init__(*args, **kwargs)
        self.add_callback(_EndStep(self))

    def _balance_attach(self) -> None:
        if self.balance_mode is None:  # the default: measure and report, change no plan
            self.balance_mode = "shadow"
        if self.balance_mode != "off" and self.balance_monitor is None:
            layout = getattr(self.packed_collator, "kind", "zigzag")
            self.balance_monitor = BalanceMonitor(self._balance_source(), mode=self.balance_mode, layout=layout)
            self._balance_mbs = 0
            for line in blind_spots(self.balance_mode, self.topology.micro_batches, self.accelerator.num_processes,
                                    getattr(self.balance_monitor.sampler, "num_windows", None)):  # fmt: skip
                logger.warning(line)

    def _balance_source(self):
        """What the monitor reads the plan through: the trainer's sampler (a stream's `StreamSteps` in
        stream.py)."""
        return self.balanced_sampler

    def _init_training_state(self, *args, **kwargs):
        if self.balance_monitor is not None:  # a second train(): its steps count from the start of a pass again
            self.balance_monitor.restart()
            self._balance_mbs = 0
        self._balance_attach()  # before the sampler loads a checkpoint's state (the monitor's part is in it)
        return super()._init_training_state(*args, **kwargs)

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        monitor = self.balance_monitor
        if monitor is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self._balance_mbs += 1
        last = self._balance_mbs % self.topology.micro_batches == 0
        with monitor.timer(synced=last and self.accelerator.num_processes > 1):
            return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict, *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs plus the monitor's figures under `balance/` (training logs only)."""
        monitor = self.balance_monitor
        if monitor is not None and "loss" in logs and monitor.ledger.steps:
            figures = monitor.log_figures()  # report()'s values, without rebuilding the whole report every log
            blind = self.topology.micro_batches == 1 and self.accelerator.num_processes > 1
            for key in LOGGED:
                if blind and key in MEASURED:  # only wait-included times: no measured figure (warned at attach)
                    continue
                value = figures[key]
                if value is not None and not (isinstance(value, float) and math.isnan(value)):
                    logs[f"balance/{key}"] = value
            if figures["rank_speeds"] is not None and not blind:
                logs.update({f"balance/rank_speed_{r}": s for r, s in enumerate(figures["rank_speeds"])})
            logs["balance/refits_accepted"] = figures["refits_accepted"]
        return super().log(logs, *args, **kwargs)


def blind_spots(mode: str, micro_batches: int, processes: int, windows: Optional[int]) -> list[str]:
    """The warnings (one line each) of a monitor that cannot measure or cannot adapt: every micro-batch synced
    (`micro_batches` = gradient_accumulation_steps 1 on several `processes`), or adapt on an epoch of one window."""
    out = []
    if micro_batches == 1 and processes > 1:
        out.append(
            f"balance: gradient_accumulation_steps=1 on {processes} processes: every micro-batch runs the gradient "
            "all-reduce and waits for the slowest rank, so the monitor measures no micro-batch's own compute; "
            "balance/measured_imbalance, idle_fraction and the prediction errors are not logged"
            + (" and balance_mode='adapt' cannot adapt" if mode == "adapt" else "")
            + "; set gradient_accumulation_steps >= 2 to measure"
        )
    if mode == "adapt" and windows == 1:
        out.append(
            "balance: balance_mode='adapt' with the epoch planned as one window: every step is planned before the "
            "first measurement, so adapt changes no plan this epoch; pass window_docs to plan window by window"
        )
    return out
