"""Every rank's monitor must plan with the same settings: checked once, at the first `end_step`.

Ranks whose monitors differ in a setting that shapes plans (mode, `every`, the warm-up and refit evidence, the
topology and its rank speeds, the cost model, the source's seed and window size) plan different windows: documents
are lost or trained twice, with no error. At the first `end_step` (which every rank reaches after the same step,
whatever its `every`) the ranks all-gather one digest per setting (48 bits of its sha256, exact in a float64) and,
besides them, one of the first step's plan as this rank reads it (what a seed, a window size or the data changes).
A mismatch raises on every rank (all see the same gathered digests) one line naming the first setting that differs
and which ranks hold which value.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from balancer.measured.monitor import BalanceMonitor

_DIGEST_BITS = 48  # below float64's 53-bit mantissa: a digest travels exactly


def plan_settings(monitor: BalanceMonitor, first_plan: Any) -> dict[str, str]:
    """The settings that shape plans, as text (name -> value), this rank's; `first_plan` is the first closed step's
    plan (window, last step of it?, piece sizes, CP groups) as the source gives it."""
    source, t = monitor.sampler, monitor.topology
    window, last, sizes, groups = first_plan
    return {
        "mode": repr(monitor.mode),
        "every": repr(monitor.every),
        "warmup_steps": repr(monitor.warmup_steps),
        "min_samples": repr(monitor.min_samples),
        "layout": repr(monitor.layout),
        "rank_speeds": repr(t.rank_speeds),
        "topology": repr(replace(t, rank_speeds=None)),
        "cost model": json.dumps(source.cost.to_dict(), sort_keys=True),
        "seed": repr(getattr(source, "seed", None)),
        "window size (window_docs)": repr(getattr(source, "window_docs", None)),
        "the first step's plan (seed, window size or data)": repr(
            (window, last, sizes, None if groups is None else np.asarray(groups).tolist())
        ),
    }


def _digest(text: str) -> float:
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> (64 - _DIGEST_BITS))


def check_settings_agree(settings: dict[str, str], group: Any, world: int, timeout: float) -> None:
    """All-gather the digests of `settings` over `group` (every rank, collective; nothing with one process) and
    raise a ValueError naming the first setting the ranks disagree on, and which ranks hold which value."""
    if world <= 1:
        return
    import torch.distributed as dist

    names = list(settings)
    mine = torch.tensor([_digest(settings[n]) for n in names], dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(parts, mine, group=group, async_op=True).wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RuntimeError(
            f"BalanceMonitor: the settings check at the first end_step failed: a rank died or did not reach "
            f"end_step within timeout={timeout:g} s ({e})"
        ) from None
    table = torch.stack(parts).numpy()
    for j, name in enumerate(names):
        column = table[:, j]
        if np.all(column == column[0]):
            continue
        kinds = {value: np.flatnonzero(column == value).tolist() for value in dict.fromkeys(column.tolist())}
        rank = dist.get_rank(group)
        shown = settings[name] if len(settings[name]) <= 80 else settings[name][:77] + "..."
        raise ValueError(
            f"BalanceMonitor: the ranks disagree on {name}: ranks {' vs '.join(map(str, kinds.values()))} hold "
            f"different values (this rank, {rank}: {shown}); every rank must plan with the same settings"
        )
