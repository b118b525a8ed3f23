"""Checking a `balancer pack` folder: `verify_packed` (checksums, row order, every row against its plan) and
`packed_metrics` (the balance of the written rows, from the rows alone)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from balancer.data.pack.output import PACK_FORMAT, is_pack_name
from balancer.data.pack.rows import SCALAR_COLUMNS, PackError, piece_positions, row_metrics, row_pieces, rows_per_epoch
from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import MANIFEST_NAME, load_json_file, verify_shard_files
from balancer.data.shards.schema import load_record
from balancer.planning.cost.model import CostModel
from balancer.planning.plans.plan import Plan
from balancer.planning.topology import Topology


def load_packed_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a finished pack folder; PackError when there is none."""
    p = Path(path) / MANIFEST_NAME
    if not p.is_file():
        raise PackError(f"{path}: no {PACK_FORMAT} {MANIFEST_NAME} (not a finished `balancer pack` output)")
    try:
        return load_record(p, "pack_manifest")  # strict: exact types, no unknown keys, known format_version
    except DataError as exc:
        raise PackError(str(exc)) from None


def is_packed(path: str | os.PathLike) -> bool:
    """Whether `path` holds a finished `balancer pack` output (its manifest says so)."""
    m = load_json_file(Path(path) / MANIFEST_NAME)
    return m is not None and m.get("format") == PACK_FORMAT


def _batches(out: Path, manifest: dict) -> Iterator[tuple[str, pa.RecordBatch]]:
    for entry in manifest["shards"]:
        name = f"{entry['name']}.arrow"
        with pa.memory_map(str(out / name), "r") as source:
            for batch in pa.ipc.open_stream(source):
                yield name, batch


def _list_parts(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets relative to the first row, values) of a list column."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy()[offsets[0] : offsets[-1]]
    return offsets - offsets[0], values


def _check_batch(batch: pa.RecordBatch, plan: Plan, epoch: int, first: int) -> list[str]:
    """Problems of rows first..first+n-1 of the epoch against the plan (the tokens themselves are checksummed)."""
    n = batch.num_rows
    keys, pieces_per_row, doc, start, stop = row_pieces(plan, first, n)
    problems = []
    want = {"epoch": np.full(n, epoch), "step": keys[:, 0], "micro_batch": keys[:, 1], "dp_rank": keys[:, 2]}
    for name in SCALAR_COLUMNS:
        if not np.array_equal(batch.column(name).to_numpy(), want[name]):
            problems.append(f"column {name} out of order (expected rows ordered epoch, step, micro-batch, DP rank)")
    piece_offsets = np.concatenate([[0], np.cumsum(pieces_per_row)])
    for name, expected in (("seq_lens", stop - start), ("doc_ids", doc), ("doc_starts", start)):
        offsets, values = _list_parts(batch.column(name))
        if not (np.array_equal(offsets, piece_offsets) and np.array_equal(values, expected)):
            problems.append(f"column {name} differs from the plan")
    token_offsets = np.concatenate([[0], np.cumsum(stop - start)])[piece_offsets]
    for name in ("input_ids", "position_ids"):
        offsets, values = _list_parts(batch.column(name))
        if not np.array_equal(offsets, token_offsets):
            problems.append(f"column {name}: row lengths differ from the sums of seq_lens")
        elif name == "position_ids" and not np.array_equal(values, piece_positions(stop - start)):
            problems.append("column position_ids does not restart at 0 for every piece")
    return problems


def check_names(out: Path, m: dict, record: str = MANIFEST_NAME) -> list[str]:
    """Shards and plans of the manifest or state `m` (file `record`) named in sequence (`shard-00000`,
    `plan-epoch-00000.json`, ...), each with exactly its own file, shards' `first_row` continuous: no name leaves
    the folder or points at another entry's file."""
    where = out / record
    for key, name_of, files_of in (
        ("shards", lambda i: f"shard-{i:05d}", lambda n: [f"{n}.arrow"]),
        ("plans", lambda i: f"plan-epoch-{i:05d}.json", lambda n: [n]),
    ):
        for i, entry in enumerate(m[key]):
            if entry["name"] != name_of(i) or sorted(entry["files"]) != files_of(entry["name"]):
                return [
                    f"{where}: {key}[{i}] is {entry['name']!r} with files {sorted(entry['files'])}, expected "
                    f"{name_of(i)!r} with {files_of(name_of(i))}"
                ]
    rows = 0
    for i, entry in enumerate(m["shards"]):
        if entry["first_row"] != rows:
            return [f"{where}: shards[{i}].first_row is {entry['first_row']}, the shards before it hold {rows} rows"]
        rows += entry["rows"]
    return []


def _check_plans_against_manifest(out: Path, m: dict, plans: list[Plan]) -> list[str]:
    """The manifest's topology, cost model, epochs and plan list against the plans it names (what the readers and
    `packed_metrics` rely on)."""
    where = out / MANIFEST_NAME
    try:
        topology = Topology.from_dict(m["topology"])
        CostModel.from_dict(m["cost_model"])
    except (ValueError, TypeError, KeyError) as exc:
        return [f"{where}: unreadable topology or cost_model ({exc})"]
    options = m["options"]
    if len(m["epochs"]) != options["epochs"]:
        return [f"{where}: {len(m['epochs'])} epochs listed, options.epochs says {options['epochs']}"]
    recorded = [p["name"] for p in m["plans"]]
    problems = []
    for i, (entry, plan) in enumerate(zip(m["epochs"], plans)):
        name = f"plan-epoch-{i:05d}.json"
        if (entry["epoch"], entry["plan"], entry["seed"]) != (i, name, options["seed"] + i):
            problems.append(f"{where}: epochs[{i}] names epoch {entry['epoch']}, {entry['plan']}, seed {entry['seed']}")
        if name not in recorded:
            problems.append(f"{where}: {name} is not in the checksummed plans list")
        if plan.topology.to_dict() != topology.to_dict():
            problems.append(
                f"{out / name}: the plan's topology {plan.topology.to_dict()} disagrees with the manifest's "
                f"{topology.to_dict()}"
            )
        elif (entry["steps"], entry["rows"]) != (plan.num_steps, rows_per_epoch(plan)):
            problems.append(
                f"{where}: epochs[{i}] says {entry['steps']} steps / {entry['rows']} rows, the plan has "
                f"{plan.num_steps} / {rows_per_epoch(plan)}"
            )
    return problems


def verify_packed(path: str | os.PathLike) -> list[str]:
    """Check a pack folder: every file's size and sha256 against the manifest, the plans, and every row against
    its plan (order, pieces, lengths, positions), the counts, no stray files. Returns the problems (empty = OK),
    each naming the file."""
    out = Path(path)
    try:
        m = load_packed_manifest(out)
    except PackError as exc:
        return [str(exc)]
    problems = check_names(out, m) or [
        bad for entry in m["plans"] + m["shards"] if (bad := verify_shard_files(out, entry))
    ]
    if problems:
        return problems
    try:
        plans = [Plan.load(out / e["plan"]) for e in m["epochs"]]
    except (ValueError, KeyError, OSError) as exc:
        return [f"{out}: unreadable plan ({exc})"]
    problems = _check_plans_against_manifest(out, m, plans)
    if problems:
        return problems
    bounds = np.cumsum([0] + [rows_per_epoch(p) for p in plans])
    row = tokens = 0
    for name, batch in _batches(out, m):
        epoch = int(np.searchsorted(bounds, row, side="right") - 1)
        if epoch >= len(plans) or row + batch.num_rows > bounds[epoch + 1]:
            problems.append(f"{out / name}: rows beyond the plans' {bounds[-1]} rows, or a batch across epochs")
            break
        problems.extend(f"{out / name}: {p}" for p in _check_batch(batch, plans[epoch], epoch, row - bounds[epoch]))
        row += batch.num_rows
        tokens += len(batch.column("input_ids").values)
    c = m["counts"]
    if (row, tokens) != (c["rows"], c["tokens"]) or row != bounds[-1]:
        problems.append(
            f"{out / MANIFEST_NAME}: counts say {c['rows']} rows / {c['tokens']} tokens, shards hold {row} / {tokens}"
        )
    expected = {MANIFEST_NAME, "state.json", "dataset_info.json"} | {
        f for e in m["plans"] + m["shards"] for f in e["files"]
    }
    stray = sorted(n for n in os.listdir(out) if is_pack_name(n) and n not in expected)
    problems.extend(f"{out / n}: unexpected file (not in the manifest)" for n in stray)
    return problems


def packed_metrics(path: str | os.PathLike) -> list[dict]:
    """Per epoch, the balance metrics of the written rows computed from their seq_lens, step, micro_batch and
    dp_rank columns alone (with the manifest's topology and cost model); equal to the plans' Plan.metrics()."""
    out = Path(path)
    m = load_packed_manifest(out)
    topology, cost = Topology.from_dict(m["topology"]), CostModel.from_dict(m["cost_model"])
    columns: dict[int, dict[str, list]] = {}
    for _, batch in _batches(out, m):
        for epoch in np.unique(batch.column("epoch").to_numpy()):
            rows = np.flatnonzero(batch.column("epoch").to_numpy() == epoch)
            cols = columns.setdefault(int(epoch), {k: [] for k in ("seq_lens", "step", "micro_batch", "dp_rank")})
            cols["seq_lens"].extend(batch.column("seq_lens").take(rows).to_pylist())
            for k in ("step", "micro_batch", "dp_rank"):
                cols[k].append(batch.column(k).to_numpy()[rows])
    return [
        row_metrics(
            c["seq_lens"],
            np.concatenate(c["step"]),
            np.concatenate(c["micro_batch"]),
            np.concatenate(c["dp_rank"]),
            topology,
            cost,
            source_tokens=m["source"]["tokens"],
        )
        for _, c in sorted(columns.items())
    ]
