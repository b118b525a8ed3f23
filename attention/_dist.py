"""Process-group helpers shared by ring, all-gather and Ulysses attention: group info, a cross-rank consistency check,
P2P exchange, a reduce-scatter whose collective is chosen by the backend, and a counter of the bytes sent.

Bytes sent (:func:`bytes_sent`) count the payload this process hands to other ranks through the attention's
transfers: a P2P send counts its tensor once; an all-gather or reduce-scatter over ``c`` ranks counts
``(c - 1)`` times this rank's block (what a ring or direct algorithm moves out of the rank; padding included); an
all-to-all counts the rows addressed to other ranks (Ulysses: both exchanges, forward and backward).
The cross-rank consistency check (a few integers per call) is not counted."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_BYTES_SENT = [0]


def bytes_sent() -> int:
    """Bytes this process has sent through CP attention transfers since the last :func:`reset_bytes_sent`."""
    return _BYTES_SENT[0]


def reset_bytes_sent() -> None:
    _BYTES_SENT[0] = 0


def count_sent(t: torch.Tensor, copies: int = 1) -> None:
    """Add ``copies`` times the bytes of ``t`` to the counter."""
    _BYTES_SENT[0] += int(t.numel()) * t.element_size() * int(copies)


def count_rows_sent(t: torch.Tensor, rows: int) -> None:
    """Add the bytes of ``rows`` rows (dim 0) of ``t`` to the counter."""
    _BYTES_SENT[0] += int(rows) * math.prod(t.shape[1:]) * t.element_size()


@dataclass(frozen=True)
class Group:
    """A process group seen from one rank: ``size``, ``rank`` (in the group), global ranks of ring neighbours."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    next_global: int
    prev_global: int
    comm_device: torch.device

    @classmethod
    def of(cls, group: Optional[dist.ProcessGroup], device: torch.device) -> Group:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("cp_attention needs an initialised torch.distributed process group")
        g = group if group is not None else dist.group.WORLD
        assert g is not None, "the default group exists once torch.distributed is initialised (checked above)"
        size, rank = dist.get_world_size(g), dist.get_rank(g)
        if rank < 0:
            raise ValueError("this process is not a member of the given process group")
        nxt, prv = dist.get_global_rank(g, (rank + 1) % size), dist.get_global_rank(g, (rank - 1) % size)
        return cls(g, size, rank, nxt, prv, comm_device(str(dist.get_backend(g)), device))


def comm_device(backend: str, device: torch.device) -> torch.device:
    """Where this group moves tensors of ``device``: the backend registered for the device type decides
    (``"cpu:gloo,cuda:nccl"`` sends CUDA tensors over nccl); gloo moves CPU tensors, so CUDA tensors on a gloo-only
    group are staged through the host."""
    return torch.device("cpu") if _backend_for(backend, device.type) == "gloo" else device


def _backend_for(backend: str, device_type: str) -> str:
    """The backend of a (possibly per-device, ``"cpu:gloo,cuda:nccl"``) backend string that handles
    ``device_type``; gloo when a per-device string names none for it."""
    backend = backend.lower()
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return per_device.get(device_type, backend if not per_device else "gloo").strip()


def consensus_check(g: Group, values: list[int], local_error: Optional[str], verified: Optional[set] = None) -> None:
    """All ranks exchange ``values`` (ints) and an error flag; every rank raises ValueError if any rank reported an
    error or the values differ, so a bad call fails everywhere instead of hanging or computing garbage.

    ``verified`` (a set kept with the layout): values already agreed on by this group are not exchanged again, so
    repeated calls (every layer, every step) cost no collective and no host sync. A rank whose values change sees a
    cache miss and exchanges them; ranks that did not change skip, so such a mismatch surfaces as a hang or a
    failed collective rather than this message."""
    key = (id(g.group), str(g.comm_device), tuple(int(x) for x in values))
    if local_error is None and verified is not None and key in verified:
        return
    t = torch.tensor(
        [0 if local_error is None else 1] + [int(x) for x in values], dtype=torch.int64, device=g.comm_device
    )
    parts = [torch.empty_like(t) for _ in range(g.size)]
    dist.all_gather(parts, t, group=g.group)
    allv = torch.stack(parts).cpu()
    if local_error is not None:
        raise ValueError(local_error)
    bad = [r for r in range(g.size) if allv[r, 0] != 0]
    if bad:
        raise ValueError(f"cp_attention: invalid inputs on rank(s) {bad} of the CP group (see their error)")
    diff = [r for r in range(g.size) if not torch.equal(allv[r, 1:], allv[g.rank, 1:])]
    if diff:
        raise ValueError(
            f"cp_attention: ranks disagree on (layout, heads, head_dim, dtype, masks, method, scale): "
            f"rank {g.rank} has {allv[g.rank, 1:].tolist()}, rank {diff[0]} has {allv[diff[0], 1:].tolist()}"
        )
    if verified is not None:
        verified.add(key)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


def sendrecv(g: Group, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
    """Post: send ``send`` to the next rank, receive ``recv`` from the previous one (zero-size transfers are skipped:
    both sides know the sizes from the layout). Returns requests to ``wait``."""
    ops = []
    if send.numel():
        count_sent(send)
        ops.append(dist.P2POp(dist.isend, send, g.next_global, g.group, tag))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, g.prev_global, g.group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


def wait_all(reqs: list) -> None:
    for r in reqs:
        r.wait()


def device_backend(g: Group) -> str:
    """The process-group backend that moves this group's tensors (the one registered for ``g.comm_device``)."""
    return _backend_for(str(dist.get_backend(g.group)), g.comm_device.type)


def reduce_scatter_sum(g: Group, blocks: list[torch.Tensor]) -> torch.Tensor:
    """``blocks[s]`` is this rank's contribution for rank ``s`` (equal shapes); returns the sum over ranks of the
    contributions for this rank. gloo: ``all_to_all`` plus a local sum (gloo's ``reduce_scatter`` exists only in
    recent PyTorch); every other backend: ``reduce_scatter``. A failing collective raises RuntimeError naming the
    backend; nothing else is tried."""
    backend = device_backend(g)
    blocks = [b.contiguous() for b in blocks]
    count_sent(blocks[0], g.size - 1)
    op = "all_to_all" if backend == "gloo" else "reduce_scatter"
    try:
        if op == "all_to_all":
            recv = [torch.empty_like(b) for b in blocks]
            dist.all_to_all(recv, blocks, group=g.group)
            return torch.stack(recv).sum(0)
        out = torch.empty_like(blocks[0])
        dist.reduce_scatter(out, blocks, op=dist.ReduceOp.SUM, group=g.group)
        return out
    except (RuntimeError, NotImplementedError, ValueError) as e:
        raise RuntimeError(
            f"cp_attention: {op} of the all-gather backward failed on the {backend!r} process-group backend "
            f"({type(e).__name__}: {e}); use method='ring', which needs only point-to-point sends"
        ) from e
