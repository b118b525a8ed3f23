"""Who contributes to a step: one small `manager.allreduce` over torchft's replica groups.

Every replica group writes one row into a `[max_groups, ROW]` float64 tensor at its participating rank (its place
in the quorum) and the tensor is summed over the groups. torchft zeroes the tensor of a group that does not
participate in the step (a group healing under async quorum: its gradients are zeroed too, so work planned for it
would be lost), so the rows left after the sum are exactly the contributing groups, the same on every group. A row
carries the group's data position (which step of which window of which epoch it is about to run: all contributors
must agree), the step's loss tokens (so that a group without the data state still learns them), the group's
`replica_id` (UTF-8 bytes, one per float: exact), its speed estimate, its last measured step and the cost model
its `BalanceMonitor` fitted in adapt mode (coefficients and the (epoch, window) it plans from; a flag 0: none).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import torch

from balancer.planning.cost.fit import TERMS

__all__ = ["Row", "exchange", "ROW", "MAX_ID_BYTES", "FIT"]

MAX_ID_BYTES = 64
_FIELDS = (
    "present",
    "epoch",
    "window",
    "step",
    "digest",
    "done",
    "loss_tokens",
    "tokens",
    "speed",
    "seconds",
    "predicted",
    "id_len",
)
FIT = 4 + len(TERMS)  # flag, epoch, window, comm_overlap, the coefficients
ROW = len(_FIELDS) + FIT + MAX_ID_BYTES


@dataclasses.dataclass(frozen=True)
class Row:
    """One replica group's row: `slot` (its participating rank), `replica_id`, its data position `(epoch, window,
    step)` and `digest` (of the re-planned window's history after an elastic resume, 0 without one), `done` (the
    epoch has no step left), the step's `loss_tokens` and `tokens`, `speed` (the group's speed estimate, 0: none
    or not planned with), its last measured step (`seconds` of compute for `predicted` cost units; 0: none), and
    `fit`: the monitor's fitted model it proposes (`FIT` floats: flag, epoch, window, comm_overlap, coefficients
    in `TERMS` order; all 0: none)."""

    slot: int
    replica_id: str
    epoch: int
    window: int
    step: int
    digest: int
    done: bool
    loss_tokens: int
    tokens: int
    speed: float
    seconds: float
    predicted: float
    fit: tuple = (0.0,) * FIT

    @property
    def position(self) -> tuple[int, int, int, int]:
        return (self.epoch, self.window, self.step, self.digest)

    def encode(self) -> np.ndarray:
        raw = self.replica_id.encode("utf-8")
        if len(raw) > MAX_ID_BYTES:
            raise ValueError(f"replica_id {self.replica_id!r} is {len(raw)} bytes in UTF-8; at most {MAX_ID_BYTES}")
        out = np.zeros(ROW, dtype=np.float64)
        out[: len(_FIELDS)] = [
            1,
            self.epoch,
            self.window,
            self.step,
            self.digest,
            float(self.done),
            self.loss_tokens,
            self.tokens,
            self.speed,
            self.seconds,
            self.predicted,
            len(raw),
        ]
        n = len(_FIELDS)
        out[n : n + FIT] = self.fit
        out[n + FIT : n + FIT + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return out

    @classmethod
    def decode(cls, slot: int, values: np.ndarray) -> Row:
        f = dict(zip(_FIELDS, values[: len(_FIELDS)].tolist()))
        n, k = int(f["id_len"]), len(_FIELDS) + FIT
        raw = bytes(int(x) for x in values[k : k + n])
        return cls(
            slot,
            raw.decode("utf-8"),
            int(f["epoch"]),
            int(f["window"]),
            int(f["step"]),
            int(f["digest"]),
            f["done"] > 0,
            int(f["loss_tokens"]),
            int(f["tokens"]),
            f["speed"],
            f["seconds"],
            f["predicted"],
            tuple(values[len(_FIELDS) : len(_FIELDS) + FIT].tolist()),
        )


def exchange(manager: Any, row: Optional[Row], max_groups: int) -> Optional[list[Row]]:
    """The contributing groups' rows (sorted by slot) after one `manager.allreduce` (every group of the quorum must
    call it, contributing or not); None when torchft reports an error for this step (the step will not commit).
    `row`: this group's row (None when it has no participating rank). A participating rank at or beyond
    `max_groups` (`topology.dp`) is refused."""
    tensor = torch.zeros((max_groups, ROW), dtype=torch.float64)
    if row is not None:
        if not 0 <= row.slot < max_groups:
            raise ValueError(
                f"replica group {row.replica_id!r} has participating rank {row.slot}, but topology.dp = {max_groups} "
                "is the largest number of replica groups: raise topology.dp"
            )
        tensor[row.slot] = torch.from_numpy(row.encode())
    from torch.distributed import ReduceOp

    work = manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
    work.wait()
    if manager.errored() is not None:
        return None
    values = tensor.numpy()
    present = values[:, 0]
    if np.any((present != 0) & (present != 1)):
        raise RuntimeError(f"two replica groups wrote the same participating rank: {present.tolist()}")
    return [Row.decode(int(i), values[i]) for i in np.flatnonzero(present == 1)]


def id_digest(text: str) -> int:
    """A 48-bit digest of `text` (exact in a float64)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:6], "big")
