"""`StepInfo`: everything a training loop asks about one step of a `BalancedBatchSampler` in one object (its
normalisers, its tokens, its micro-batch count and the plan's prediction), instead of one accessor per figure."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from balancer.training.sampler import BalancedBatchSampler

from dataclasses import dataclass

import numpy as np

from balancer.planning.metrics import lower_bound, one_f_one_b


@dataclass(frozen=True)
class StepInfo:
    """One step as planned. `loss_tokens` and `num_sequences` are the global normalisers of
    `balancer.loss.token_loss` (token and sequence reductions; valid when every token is a target), `tokens` the
    step's real tokens, `micro_batches` the micro-batches every rank runs in it (M' for a short last step),
    `predicted_times` this rank's view of the micro-batches' predicted times (`sampler.predicted_times`) and
    `predicted` the step's predicted telemetry (`sampler.predicted_step`: replica times, step time, lower bound,
    imbalance)."""

    step: int
    micro_batches: int
    tokens: int
    loss_tokens: int
    num_sequences: int
    predicted_times: np.ndarray
    predicted: dict


def step_info(sampler: BalancedBatchSampler, step: int) -> StepInfo:
    """The `StepInfo` of `step` of `sampler` (global step index, as the sampler's other per-step accessors)."""
    sizes = sampler.step_sizes(step)
    return StepInfo(
        step=int(step),
        micro_batches=sampler.step_micro_batches(step),
        tokens=int(sizes.sum()),
        loss_tokens=int((sizes - 1).sum()),
        num_sequences=int((sizes > 1).sum()),
        predicted_times=sampler.predicted_times(step),
        predicted=sampler.predicted_step(step),
    )


def predicted_step(sampler: BalancedBatchSampler, step: int) -> dict:
    """`sampler.predicted_step(step)`: the plan's predicted replica times, step time, lower bound and imbalance."""
    t = sampler.topology
    mb = sampler.predicted_times(step)
    if t.dynamic:  # the step time needs every rank's waits: the plan's model; no per-replica times
        w, local = sampler.windows.locate(int(step))
        seg = sampler.windows.segment(w)
        rep = np.array([seg.plan.step_times()[local]])
    else:
        rep = one_f_one_b(mb.max(axis=1), mb.sum(axis=1), t.pp)
    c = sampler.cost.cost(sampler.step_sizes(step))
    lb = float(lower_bound(c.sum(), c.max(), t, sampler.cost.fixed, micro_batches=sampler.step_micro_batches(step)))
    return {
        "replica_times": rep,
        "step_time": float(rep.max()),
        "lower_bound": float(lb),
        "imbalance": float(rep.max() / lb) if lb > 0 else 1.0,
        "loss_tokens": sampler.step_loss_tokens(step),
        "tokens": sampler.step_tokens(step),
    }
