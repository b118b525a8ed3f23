"""The two collectives of a stream window, both on the stream's own gloo group (run by its background thread).

`all_gather_records`: ONE `all_gather` of a fixed-size int64 record per rank: a status word (0 = read fine, 1 =
the source failed), per stream the documents given to the window, whether it finished and the documents it holds
for the next window, the lengths and loss-token counts of the documents given, and on failure the error text
(UTF-8, cut to MESSAGE_BYTES). Every rank knows every record's size in advance (the quotas are derived from what
earlier gathers shared), so no size exchange is needed, and a rank whose source failed still joins the gather:
every rank then raises the same error instead of waiting for it.

`exchange_rows`: the documents to the processes that train them, pickled per destination, with two
`all_to_all_single` calls (the byte counts, then the bytes); a process's own documents are not serialised.
The bytes sent to other processes are counted and returned.

A collective that fails (a process of the group died: gloo's connection reset; or one did not reach it within the
group's timeout: the stream's `timeout`) raises `StreamPeerError`, which the window job completes with a line naming
the window and the timeout (windows.py): the surviving ranks get that error instead of waiting forever.
"""

from __future__ import annotations

import datetime
import math
import numbers
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # torch is imported inside the functions
    import torch.distributed as dist

    from balancer.planning.topology import Topology

MESSAGE_BYTES = 1024
_HEADER = 1  # the status word
_PER_STREAM = 3  # documents given, finished (0/1), documents held for the next window


class StreamSourceError(RuntimeError):
    """A rank's source failed while a window was read; raised on every rank."""


class StreamPeerError(RuntimeError):
    """A collective of the stream's own group failed: a process of the group died, stalled past the stream's
    `timeout`, or stopped reading before this window (raised on the ranks that reached it)."""


def checked_seconds(name: str, value: object) -> float:
    """`value` as float seconds: a finite real number > 0 that is not a bool; a ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise ValueError(f"{name} must be a finite positive number of seconds, got {type(value).__name__} {value!r}")
    return float(value)


def _collective(what: str, call: Callable[[], object]) -> None:
    """Run one collective of the stream's group; gloo's failure (a RuntimeError) becomes a StreamPeerError."""
    try:
        call()
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise StreamPeerError(f"the stream's {what} failed ({first})") from e


def record_size(streams: int, docs: int) -> int:
    """int64 words of a record for a rank reading `streams` streams and giving at most `docs` documents."""
    return _HEADER + _PER_STREAM * streams + 2 * docs + MESSAGE_BYTES // 8


def encode_record(
    size: int,
    per_stream: np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    losses: Sequence[int] | np.ndarray,
    error: str | None,
) -> np.ndarray:
    """One rank's record (module docstring): `per_stream` [k, 3] (documents given, finished, documents held),
    then the given documents' lengths and loss-token counts; zero-padded to `size` words."""
    out = np.zeros(size, dtype=np.int64)
    k, n = len(per_stream), len(lengths)
    out[0] = 0 if error is None else 1
    body = _HEADER + _PER_STREAM * k
    out[_HEADER:body] = np.asarray(per_stream, dtype=np.int64).reshape(-1)
    out[body : body + n] = lengths
    out[body + n : body + 2 * n] = losses
    if error is not None:
        text = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
        raw = error.encode("utf-8", "replace")[:MESSAGE_BYTES]
        text[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        out[size - MESSAGE_BYTES // 8 :] = text.view(np.int64)
    return out


def decode_record(rec: np.ndarray, streams: int) -> tuple:
    """(error text or None, per_stream [k, 3], lengths, losses) of a record for `streams` streams."""
    if rec[0]:
        raw = rec[len(rec) - MESSAGE_BYTES // 8 :].view(np.uint8).tobytes().rstrip(b"\0")
        return raw.decode("utf-8", "replace"), None, None, None
    body = _HEADER + _PER_STREAM * streams
    per = rec[_HEADER:body].reshape(streams, _PER_STREAM).copy()
    n = int(per[:, 0].sum())
    return None, per, rec[body : body + n].copy(), rec[body + n : body + 2 * n].copy()


def all_gather_records(record: np.ndarray, group: Optional[dist.ProcessGroup], world: int) -> list[np.ndarray]:
    """Every rank's record (same size on every rank) in rank order: one all_gather."""
    import torch
    import torch.distributed as dist

    if world == 1:
        return [record]
    mine = torch.from_numpy(record)
    out = [torch.empty_like(mine) for _ in range(world)]
    _collective("all_gather", lambda: dist.all_gather(out, mine, group=group))
    return [t.numpy() for t in out]


def exchange_rows(outgoing: list[list], group: Optional[dist.ProcessGroup], world: int, rank: int) -> tuple[list, int]:
    """`outgoing[dest]`: the (key, row) pairs for process `dest`. Returns (the pairs this process receives, from
    every source rank in rank order, and the bytes it sent to other processes). A row this process cannot pickle
    is announced with a byte count of -1 to every process, so every process raises a StreamSourceError naming this
    one (none waits in the second all-to-all for bytes that never come)."""
    if world == 1:
        return list(outgoing[0]), 0
    import torch
    import torch.distributed as dist

    blobs, failure = _pickled(outgoing, world, rank)
    send_sizes = torch.tensor([-1] * world if failure else [len(b) for b in blobs], dtype=torch.int64)
    recv_sizes = torch.empty(world, dtype=torch.int64)
    _collective("all_to_all of byte counts", lambda: dist.all_to_all_single(recv_sizes, send_sizes, group=group))
    failed = [src for src, size in enumerate(recv_sizes.tolist()) if size < 0]
    if failure or failed:
        raise StreamSourceError(
            f"rank {rank}'s documents could not be sent: {failure}"
            if failure
            else f"rank {failed[0]}'s documents could not be sent (a row it read cannot be pickled; its error names it)"
        )
    send = torch.from_numpy(np.frombuffer(b"".join(blobs), dtype=np.uint8).copy())
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    counts = (recv_sizes.tolist(), send_sizes.tolist())
    _collective("all_to_all of documents", lambda: dist.all_to_all_single(recv, send, *counts, group=group))
    got, at = [], 0
    raw = recv.numpy()
    for src, size in enumerate(recv_sizes.tolist()):
        if src == rank:
            got.extend(outgoing[rank])
        elif size:
            got.extend(pickle.loads(raw[at : at + size].tobytes()))
        at += size
    return got, int(send_sizes.sum())


def _pickled(outgoing: list[list], world: int, rank: int) -> tuple[list[bytes], str]:
    """The pickled rows per destination (this process's own: none), or the first row that cannot be pickled
    described in one line."""
    blobs = []
    for dest in range(world):
        if dest == rank or not outgoing[dest]:
            blobs.append(b"")
            continue
        try:
            blobs.append(pickle.dumps(outgoing[dest], 5))
        except Exception as e:  # pickle raises TypeError, PicklingError, AttributeError... by what the row holds
            return [], f"a row for rank {dest} cannot be pickled ({type(e).__name__}: {str(e).splitlines()[0]})"
    return blobs, ""


def stream_group(group: Optional[dist.ProcessGroup], timeout: float) -> tuple:
    """(the stream's own gloo group, its size, this process's rank in it); (None, 1, 0) without torch.distributed.
    Creating the group is collective over the default group (torch.distributed.new_group); its collectives wait at
    most `timeout` seconds for the other processes."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group given but torch.distributed is not initialised")
        return None, 1, 0
    ranks = None if group is None else dist.get_process_group_ranks(group)
    own = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    if ranks is not None and dist.get_rank(group) < 0:  # ranks: the given group's
        return own, len(ranks), -1
    return own, dist.get_world_size(own), dist.get_rank(own)


def pool_rank(topology: Topology, world: int, grank: int, dp_rank: Optional[int], rank: Optional[int]) -> int:
    """This process's pool rank from its place in the group (module docstring of BalancedStream), checked against
    `dp_rank` / `rank` when given."""
    if grank < 0:
        raise ValueError("this process is not in the stream's group")
    pool = topology.pool_size
    import torch.distributed as dist

    if pool > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"torch.distributed is not initialised: a stream in one process needs dp*cp == 1, the topology has {pool}"
        )
    if world % pool:
        raise ValueError(
            f"the stream's group has {world} processes, not a multiple of dp*cp = {pool} (one block of processes per "
            "pool rank)"
        )
    mine = grank // (world // pool)
    if rank is not None and (isinstance(rank, bool) or rank != mine):
        raise ValueError(f"rank={rank!r}, but process {grank} of {world} is pool rank {mine} (dp_rank*cp + cp_rank)")
    if dp_rank is not None and (isinstance(dp_rank, bool) or dp_rank != mine // topology.cp):
        raise ValueError(f"dp_rank={dp_rank!r}, but process {grank} of {world} is DP rank {mine // topology.cp}")
    return mine
