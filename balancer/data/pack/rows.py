"""Rows of a packed folder (`balancer pack`): planning the epochs over a pretokenized folder and turning every
(epoch, step, micro-batch, DP rank) of the plans into one row of tokens.

A row holds one whole micro-batch: the pieces (whole documents, or the part of a document the plan places there)
concatenated in the plan's packing order. Columns: `input_ids` (the source's token dtype), `position_ids` (int32,
restarting at 0 for every piece), `seq_lens` (int32, tokens per piece), `doc_ids` (int64, row indices of the source
folder: the ids the plans use), `doc_starts` (int64, the first token of each piece inside its document; 0 for whole
documents), and `epoch`, `step`, `micro_batch`, `dp_rank` (int32). Rows are ordered (epoch, step, micro-batch, DP
rank): row i belongs to DP rank `i % dp`.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from balancer.data.shards.checks import open_folder
from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.manifest import MANIFEST_NAME, shard_file_names
from balancer.planning.cost.model import CostModel
from balancer.planning.metrics import step_times, summarize
from balancer.planning.planner import plan as make_plan
from balancer.planning.plans.plan import Plan
from balancer.planning.topology import Topology

SCALAR_COLUMNS = ("epoch", "step", "micro_batch", "dp_rank")


class PackError(DataError):
    """`balancer pack` cannot proceed: not a pretokenized folder, a topology that cannot hold a document, ..."""


def pack_features(dtype: np.dtype) -> Any:
    """The `datasets.Features` of a packed row (see the module docstring)."""
    import datasets

    ints = {name: datasets.Value("int32") for name in SCALAR_COLUMNS}
    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value(np.dtype(dtype).name)),
            "position_ids": datasets.List(datasets.Value("int32")),
            "seq_lens": datasets.List(datasets.Value("int32")),
            "doc_ids": datasets.List(datasets.Value("int64")),
            "doc_starts": datasets.List(datasets.Value("int64")),
            **ints,
        }
    )


# ----------------------------------------------------------------------------------------------------------------
# the source folder


class SourceTokens:
    """Token ids of a finished pretokenize folder, by row, read with `os.preadv` at byte offsets found once through
    a memory map: reads go through the page cache and never into this process's resident set, so its memory stays
    flat however much of the folder it reads. `close()` closes the files."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST_NAME).is_file():
            raise PackError(
                f"{path}: no {MANIFEST_NAME}: not a finished `balancer pretokenize` output (pack reads those)"
            )
        opened = open_folder(self.path)  # structure, sizes, index checksums, Arrow row counts
        self.manifest = opened.manifest
        self.lengths, self._doc_ids = opened.lengths(), opened.doc_ids()
        self.dtype = np.dtype(self.manifest["tokenizer"]["dtype"])
        self._fds: list[int] = []
        row_file, row_byte, row_len = [], [], []
        try:
            for entry in self.manifest["shards"]:
                arrow = self.path / shard_file_names(entry["name"])[0]
                self._fds.append(os.open(arrow, os.O_RDONLY))
                for byte, lengths in self._chunk_layout(arrow):
                    row_file.append(np.full(len(lengths), len(self._fds) - 1, dtype=np.int32))
                    row_byte.append(byte)
                    row_len.append(lengths)
        except BaseException:
            self.close()
            raise
        self.row_file = np.concatenate(row_file) if row_file else np.zeros(0, np.int32)
        self.row_byte = np.concatenate(row_byte) if row_byte else np.zeros(0, np.int64)
        if not np.array_equal(np.concatenate(row_len) if row_len else self.lengths[:0], self.lengths):
            self.close()
            raise PackError(f"{self.path}: the lengths index differs from the token data; run `balancer verify`")
        if len(self.lengths) == 0:
            self.close()
            raise PackError(f"{self.path}: holds no rows: there is nothing to pack")

    def _chunk_layout(self, arrow: Path) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per record batch of the shard: (file byte offset of every row's first token, row lengths)."""
        with open(arrow, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            base = pa.py_buffer(mm)
            chunks = pa.ipc.open_stream(pa.BufferReader(base)).read_all().column("input_ids").chunks
            layout = []
            for chunk in chunks:
                values = chunk.values
                if values.type.to_pandas_dtype() != self.dtype:
                    raise PackError(f"{arrow}: token ids are {values.type}, the manifest says {self.dtype}")
                start = values.buffers()[1].address - base.address + values.offset * self.dtype.itemsize
                offsets = chunk.offsets.to_numpy().astype(np.int64)
                layout.append((start + offsets[:-1] * self.dtype.itemsize, np.diff(offsets)))
            return layout
        except (pa.ArrowException, KeyError) as exc:
            raise PackError(f"{arrow}: unreadable shard ({exc}); run `balancer verify {self.path}`") from None
        # the map is unmapped when the last Arrow buffer over it goes, on return

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def read(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Tokens `[starts[k], ends[k])` of source row `rows[k]` for every k, concatenated (a new array)."""
        lens = np.asarray(ends) - np.asarray(starts)
        out = np.empty(int(lens.sum()), dtype=self.dtype)
        view = out.data.cast("B")
        size = self.dtype.itemsize
        pos = 0
        byte = self.row_byte[rows] + np.asarray(starts) * size
        for fd, at, n in zip(self.row_file[rows].tolist(), byte.tolist(), (lens * size).tolist()):
            if os.preadv(self._fds[fd], [view[pos : pos + n]], at) != n:
                raise PackError(f"{self.path}: a shard is shorter than its index; run `balancer verify`")
            pos += n
        return out

    def doc_id(self, row: int) -> int:
        """The source record (input document) row `row` came from."""
        return int(self._doc_ids[row])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> SourceTokens:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------
# planning


def check_static(topology: Topology) -> None:
    """Packed rows are per (step, micro-batch, DP rank): a dynamic-CP topology regroups ranks every slot."""
    cp_sizes = getattr(topology, "cp_sizes", None)
    if cp_sizes:
        raise PackError(
            f"pack writes one row per (step, micro-batch, DP rank) of a static CP topology, but this topology has "
            f"cp_sizes={tuple(cp_sizes)} (dynamic CP regroups the ranks in every micro-batch slot); drop "
            f"{arg('cp_sizes')}, or train from the plan with BalancedBatchSampler"
        )


def check_fits(source: SourceTokens, topology: Topology, overflow: str) -> None:
    """A static topology whose micro-batches can hold every row of the source (or an overflow policy that cuts)."""
    check_static(topology)
    lengths = source.lengths
    cap = topology.micro_batch_tokens
    if overflow == "error" and int(lengths.max()) > cap:
        row = int(np.argmax(lengths > cap))
        raise PackError(
            f"{source.path}: row {row} (source record {source.doc_id(row)}) has {int(lengths[row])} tokens, more "
            f"than a micro-batch holds ({arg('max_tokens')} x {arg('cp')} = "
            f"{topology.max_tokens} x {topology.cp} = {cap}; "
            f"{int((lengths > cap).sum())} rows are over); pass {arg('overflow', 'split')} to place it in windows over "
            f"several micro-batches, or raise {arg('max_tokens')} or {arg('cp')}"
        )


def plan_epoch(source: SourceTokens, topology: Topology, cost: CostModel, seed: int, overflow: str, epoch: int) -> Plan:
    """The plan of epoch `epoch` (seed `seed + epoch`) over the source folder's rows."""
    try:
        plan = make_plan(source.lengths, topology, cost, seed=seed + epoch, overflow=overflow)
    except ValueError as exc:  # pack writes no filler rows: the planner's opt-in does not apply here
        raise PackError(f"epoch {epoch}: {str(exc).split('; or pass filler_rows=True')[0]}") from None
    plan.plan_seconds = 0.0  # timing is not part of the (byte-identical) output
    return plan


# ----------------------------------------------------------------------------------------------------------------
# rows


def rows_per_epoch(plan: Plan) -> int:
    """One row per micro-batch and DP rank: `dp * micro_batches` per step, `dp * M'` in a short last step."""
    return len(plan.mb_ptr) - 1


def row_keys(plan: Plan, first: int, count: int) -> np.ndarray:
    """[count, 4] (step, micro_batch, dp_rank, flat micro-batch index in the plan) of rows first..first+count-1 of
    the epoch, in row order (step, micro-batch, DP rank)."""
    t = plan.topology
    i = np.arange(first, first + count, dtype=np.int64)
    step = np.minimum(i // t.bins_per_step, plan.num_steps - 1)  # a short last step has dp * M' rows
    micro_batch, dp_rank = np.divmod(i - step * t.bins_per_step, t.dp)
    per_replica = np.where(step == plan.num_steps - 1, plan.last_micro_batches, t.micro_batches)
    flat = step * t.bins_per_step + dp_rank * per_replica + micro_batch
    return np.stack([step, micro_batch, dp_rank, flat], axis=1)


def row_pieces(plan: Plan, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows first..first+count-1 of the epoch: (keys [count, 4] as in `row_keys`, pieces per row, and the pieces'
    doc, start, end, concatenated in row order)."""
    keys = row_keys(plan, first, count)
    flat = keys[:, 3]
    begin = plan.mb_ptr[flat]
    pieces_per_row = plan.mb_ptr[flat + 1] - begin
    idx = np.repeat(begin - np.cumsum(pieces_per_row) + pieces_per_row, pieces_per_row)
    idx += np.arange(len(idx))
    return keys, pieces_per_row, plan.doc[idx], plan.start[idx], plan.end[idx]


def piece_positions(seq_lens: np.ndarray) -> np.ndarray:
    """int32 positions restarting at 0 for every piece."""
    piece_first = np.cumsum(seq_lens) - seq_lens
    return (np.arange(int(np.sum(seq_lens)), dtype=np.int64) - np.repeat(piece_first, seq_lens)).astype(np.int32)


def build_rows(
    source: SourceTokens, plan: Plan, epoch: int, first: int, count: int, schema: pa.Schema
) -> pa.RecordBatch:
    """Rows first..first+count-1 of the epoch as one Arrow record batch (tokens copied out of the source)."""
    keys, pieces_per_row, doc, start, stop = row_pieces(plan, first, count)
    seq_lens = stop - start
    tokens = source.read(doc, start, stop)
    positions = piece_positions(seq_lens)
    piece_offsets = np.concatenate([[0], np.cumsum(pieces_per_row)]).astype(np.int32)
    token_offsets = np.concatenate([[0], np.cumsum(seq_lens)])[piece_offsets].astype(np.int32)

    def lists(offsets: np.ndarray, values: np.ndarray, dtype) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(values, dtype=dtype)))

    columns = [
        lists(token_offsets, tokens, source.dtype),
        lists(token_offsets, positions, np.int32),
        lists(piece_offsets, seq_lens, np.int32),
        lists(piece_offsets, doc, np.int64),
        lists(piece_offsets, start, np.int64),
        pa.array(np.full(count, epoch, dtype=np.int32)),
        *(pa.array(keys[:, j].astype(np.int32)) for j in range(3)),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def row_tokens(plan: Plan) -> np.ndarray:
    """Tokens of every row of the epoch, in row order."""
    keys = row_keys(plan, 0, rows_per_epoch(plan))
    return plan.flat_micro_batch_tokens()[keys[:, 3]]


# ----------------------------------------------------------------------------------------------------------------
# balance from the rows alone


def row_metrics(
    seq_lens: list,
    step: np.ndarray,
    micro_batch: np.ndarray,
    dp_rank: np.ndarray,
    topology: Topology,
    cost: CostModel,
    source_tokens: Optional[int] = None,
) -> dict:
    """The plan metrics (balancer.planning.metrics) of one epoch's rows, from their `seq_lens`, `step`,
    `micro_batch` and `dp_rank` columns alone. `source_tokens` (the source folder's total) gives `dropped_tokens`."""
    t = topology
    step, micro_batch, dp_rank = (np.asarray(x, dtype=np.int64) for x in (step, micro_batch, dp_rank))
    steps = int(step.max()) + 1 if len(step) else 0
    piece_counts = np.fromiter((len(x) for x in seq_lens), dtype=np.int64, count=len(seq_lens))
    lens = np.concatenate([np.asarray(x, dtype=np.int64) for x in seq_lens]) if len(seq_lens) else np.zeros(0)
    piece_cost = cost.cost(lens)
    piece_row = np.repeat(np.arange(len(seq_lens)), piece_counts)
    row_cost = np.bincount(piece_row, weights=piece_cost, minlength=len(seq_lens)) + cost.fixed
    mb_cost = np.zeros((steps, t.dp, t.micro_batches))
    mb_cost[step, dp_rank, micro_batch] = row_cost
    piece_step = step[piece_row]
    work = np.bincount(piece_step, weights=piece_cost, minlength=steps)
    most = np.zeros(steps)
    np.maximum.at(most, piece_step, piece_cost)
    total = int(lens.sum())
    return summarize(
        step_times(mb_cost, t),
        work,
        most,
        t,
        cost,
        total_tokens=total,
        dropped_tokens=0 if source_tokens is None else int(source_tokens) - total,
        micro_batches=np.bincount(step, minlength=steps) // t.dp,  # a short last step: M' rows per DP rank
    )
