"""The training loss a balanced trainer logs: every rank holds only its share of each step's globally normalised
loss (`balancer.loss.token_loss`), so the figure logged is the mean of the shares over the processes, a collective
(`process_mean`). Shared by `BalancedTrainer` and the TRL trainers of balancer.integrations."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["process_mean"]


def process_mean(t: torch.Tensor) -> torch.Tensor:
    """`t` averaged over all processes of the default group (unchanged on one, or without torch.distributed);
    collective: every process calls it. Summed in float64 (on the CPU under gloo), returned in `t`'s dtype and
    device."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return t
    on = torch.device("cpu") if dist.get_backend() == "gloo" else t.device
    x = t.detach().to(on, torch.float64).clone()
    dist.all_reduce(x)
    return (x / dist.get_world_size()).to(t.device, t.dtype)
