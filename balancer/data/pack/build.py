"""`balancer pack`: balanced, pre-packed rows for loaders that cannot take a sampler.

Plans every epoch of a pretokenized folder for a topology (epoch e with seed S+e) and writes a `datasets` folder
with one row per (epoch, step, micro-batch, DP rank), in that order (row format: `balancer.data.pack.rows`)::

    DIR/shard-00000.arrow          Arrow IPC stream of rows (one shard closes at a row boundary after --shard-tokens)
    DIR/plan-epoch-00000.json      the plan of epoch 0 (balancer plan JSON), ... one per epoch
    DIR/state.json, dataset_info.json   `datasets.load_from_disk(DIR)` loads every shard as one Dataset
    DIR/manifest.json              written last, atomically; its presence means the job is complete
    DIR/.pack-state.json           progress while running (plans, finished shards); written at a run's start and end
    DIR/.pack-state.json.journal   one checksummed line per file recorded since (balancer.data.shards.journal)

Crash safety and resume follow `balancer pretokenize`: files are written under temporary names, fsynced, renamed
and recorded with their checksums in the state's journal; a rerun of the same job keeps what verifies and continues
after the last finished shard, so the folder ends byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from balancer.data.pack.output import (
    PACK,
    PACK_DESCRIPTION,
    PACK_FORMAT,
    PACK_FORMAT_VERSION,
    PACK_STATE_NAME,
    clear_owned,
    prepare_pack_output,
)
from balancer.data.pack.rows import (
    PackError,
    SourceTokens,
    build_rows,
    check_fits,
    check_static,
    pack_features,
    plan_epoch,
    row_metrics,
    row_tokens,
    rows_per_epoch,
)
from balancer.data.pack.verify import check_names, is_packed, load_packed_manifest, packed_metrics, verify_packed
from balancer.data.shards.arrow_rows import ArrowHeaderError, stream_row_count
from balancer.data.shards.errors import arg
from balancer.data.shards.journal import (
    JournaledState,
    journal_path,
    load_state,
    remove_state,
)
from balancer.data.shards.limits import check_count, check_pack_topology
from balancer.data.shards.manifest import MANIFEST_NAME, atomic_write_json, fsync_file, sha256_file, verify_shard_files
from balancer.data.shards.output import is_our_record, open_output
from balancer.data.shards.schema import state_header
from balancer.data.shards.writer import FLUSH_ROWS, FLUSH_TOKENS, new_arrow_sink, write_datasets_metadata
from balancer.limits import DEFAULT_SHARD_TOKENS, MAX_EPOCHS, MAX_PACK_SEED, MAX_SHARD_TOKENS
from balancer.planning.cost.model import CostModel
from balancer.planning.plans.plan import Plan
from balancer.planning.topology import Topology
from balancer.temporaries import note_temporary

OVERFLOW_CHOICES = ("error", "split", "truncate")

__all__ = [
    "pack",
    "verify_packed",
    "packed_metrics",
    "is_packed",
    "load_packed_manifest",
    "row_metrics",
    "PackError",
    "PACK_FORMAT",
]


def plan_file_name(epoch: int) -> str:
    return f"plan-epoch-{epoch:05d}.json"


# ----------------------------------------------------------------------------------------------------------------
# writing


def _finish_file(tmp: Path, final: Path, run: JournaledState) -> dict:
    """fsync `tmp`, record its size and checksum as pending in the journal (so that the file is provably ours once
    renamed), rename it to `final`."""
    fsync_file(tmp)
    meta = {"bytes": os.path.getsize(tmp), "sha256": sha256_file(tmp)}
    run.record({"pending": [{"name": final.name, "files": {final.name: meta}}]})
    os.replace(tmp, final)
    note_temporary(tmp, False)
    return meta


class RowShardWriter:
    """Streams record batches of rows into `DIR/shard-NNNNN.arrow` under a temporary name; `close()` finishes it."""

    def __init__(self, out: Path, index: int, schema: pa.Schema, first_row: int) -> None:
        self.out, self.name, self.first_row = out, f"shard-{index:05d}", first_row
        self.tmp = out / f"{self.name}.arrow.tmp"
        self.sink = new_arrow_sink(self.tmp)
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.rows = self.tokens = 0

    def write(self, batch: pa.RecordBatch, tokens: int) -> None:
        self.writer.write_batch(batch)
        self.rows += batch.num_rows
        self.tokens += tokens

    def close(self, run: JournaledState) -> dict:
        self.writer.close()
        self.sink.close()
        meta = _finish_file(self.tmp, self.out / f"{self.name}.arrow", run)
        return {
            "name": self.name,
            "first_row": self.first_row,
            "rows": self.rows,
            "tokens": self.tokens,
            "files": {f"{self.name}.arrow": meta},
        }

    def abort(self) -> None:
        try:
            self.writer.close()
            self.sink.close()
        except Exception:  # noqa: BLE001
            pass


def _batch_end(tokens: np.ndarray, row: int, limit: int) -> int:
    """End of the record batch starting at `row`: at most FLUSH_ROWS rows, closed at the row that reaches `limit`
    tokens (boundaries depend only on the rows and the shard's start, so a resumed run cuts the same way)."""
    end = min(row + FLUSH_ROWS, len(tokens))
    reach = int(np.searchsorted(np.cumsum(tokens[row:end]), limit))
    return min(end, row + reach + 1)


def _write_rows(
    out: Path,
    source: SourceTokens,
    plans: list[Plan],
    run: JournaledState,
    shard_tokens: int,
    progress: Optional[bool],
) -> None:
    """Write every row after the state's finished shards; each finished shard is one line of the journal."""
    schema = pack_features(source.dtype).arrow_schema
    shards = run.state["shards"]
    done = sum(s["rows"] for s in shards)
    writer: Optional[RowShardWriter] = None

    def close_shard() -> None:
        nonlocal writer
        assert writer is not None, "called only with a shard open"
        run.record({"shard": writer.close(run)})
        writer = None

    total = sum(rows_per_epoch(p) for p in plans)
    bar = tqdm(total=total, initial=done, unit="row", desc="pack", disable=None if progress is None else not progress)
    epoch_first = 0
    try:
        for epoch, plan in enumerate(plans):
            count = rows_per_epoch(plan)
            row = max(0, done - epoch_first)
            tokens = row_tokens(plan) if row < count else np.zeros(0, dtype=np.int64)  # nothing left: no rows
            while row < count:
                if writer is None:
                    writer = RowShardWriter(out, len(shards), schema, epoch_first + row)
                end = _batch_end(tokens, row, min(FLUSH_TOKENS, shard_tokens - writer.tokens))
                writer.write(build_rows(source, plan, epoch, row, end - row, schema), int(tokens[row:end].sum()))
                bar.update(end - row)
                row = end
                if writer.tokens >= shard_tokens:
                    close_shard()
            epoch_first += count
        if writer is not None:
            close_shard()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()


# ----------------------------------------------------------------------------------------------------------------
# the job


def _job_key(source: SourceTokens, topology: Topology, cost: CostModel, epochs: int, seed: int, opts: dict) -> str:
    key = {
        "format": [PACK_FORMAT, PACK_FORMAT_VERSION],
        "source_manifest_sha256": sha256_file(source.path / MANIFEST_NAME),
        "topology": topology.to_dict(),
        "cost_model": cost.to_dict(),
        "epochs": epochs,
        "seed": seed,
        **opts,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _plans(out: Path, source: SourceTokens, topology, cost, epochs, seed, overflow, run: JournaledState) -> list[Plan]:
    """Every epoch's plan: loaded when the state records it (the first ones; it must verify), else planned, saved
    atomically and recorded in the journal."""
    check_fits(source, topology, overflow)
    plans = []
    for epoch in range(epochs):
        name = plan_file_name(epoch)
        if epoch < len(run.state["plans"]):  # named in sequence (check_names), checksummed by the ownership rules
            problem = verify_shard_files(out, run.state["plans"][epoch])
            if problem is not None:
                raise PackError(f"{problem}; pass {arg('overwrite', True)}")
            plans.append(Plan.load(out / name))
            continue
        plan = plan_epoch(source, topology, cost, seed, overflow, epoch)
        note_temporary(out / (name + ".tmp"), True)  # Plan.save's own temporary file is recorded by atomic_write
        plan.save(out / (name + ".tmp"))
        meta = _finish_file(out / (name + ".tmp"), out / name, run)
        run.record({"plan": {"name": name, "files": {name: meta}}})
        plans.append(plan)
    return plans


def pack(
    source: str | os.PathLike | SourceTokens,
    output: str | os.PathLike,
    topology: Topology,
    cost: CostModel,
    *,
    epochs: int = 1,
    seed: int = 0,
    overflow: str = "error",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: Optional[bool] = None,
) -> dict:
    """Plan `epochs` epochs of the pretokenized folder `source` for `topology` (epoch e with seed `seed + e`) and
    write one row per (epoch, step, micro-batch, DP rank) into the `datasets` folder `output`, plans beside them.

    `overflow` handles rows longer than a micro-batch (`max_tokens * cp`): "error" (default) refuses them, "split"
    places windows of them in several micro-batches, "truncate" keeps their first `max_tokens * cp` tokens (the
    rest counted as dropped). A killed run resumes when called again with the same arguments; a finished folder
    is verified and returned as is. Returns the manifest; raises PackError on bad input or a refused folder
    (DataError, its base class, for a folder that another run is writing or that is one of the inputs).
    `progress`: None = a bar only on a terminal."""
    check_static(topology)
    check_pack_topology(topology)
    if overflow not in OVERFLOW_CHOICES:
        raise PackError(f"{arg('overflow')} must be one of {OVERFLOW_CHOICES}, got {overflow!r}")
    check_count("epochs", epochs, 1, MAX_EPOCHS)
    check_count("seed", seed, 0, MAX_PACK_SEED)
    check_count("shard_tokens", shard_tokens, 1, MAX_SHARD_TOKENS)
    if isinstance(source, SourceTokens):
        return _pack(source, Path(output), topology, cost, epochs, seed, overflow, shard_tokens, overwrite, progress)
    with SourceTokens(source) as src:
        return _pack(src, Path(output), topology, cost, epochs, seed, overflow, shard_tokens, overwrite, progress)


def _resume_state(out: Path, job: str, prev: Optional[dict]) -> dict:
    """The state to continue from: the recorded plans and shards, refused (naming the state file) when they
    disagree with the files on disk (None: a fresh start)."""
    state = {**state_header("pack_state"), "job": job, "plans": [], "shards": []}
    if prev is None:
        return state
    prev = load_state(out / PACK_STATE_NAME, "pack_state")  # with its journal; strict: exact types, no unknown keys
    problems = check_names(out, prev, PACK_STATE_NAME)
    if problems:
        raise PackError(f"{problems[0]}; the state disagrees with the files on disk: pass {arg('overwrite', True)}")
    for entry in prev["plans"] + prev["shards"]:  # sizes and sha256 were checked by the ownership rules
        for name in entry["files"]:
            if not (out / name).is_file():
                raise PackError(
                    f"{out / PACK_STATE_NAME}: records {name}, which is missing; pass {arg('overwrite', True)}"
                )
    for entry in prev["shards"]:  # the resume position is the sum of the recorded rows: they must be the file's
        arrow = out / f"{entry['name']}.arrow"
        try:
            found = stream_row_count(arrow)
        except ArrowHeaderError as exc:
            raise PackError(f"{exc}; pass {arg('overwrite', True)}") from None
        if found != entry["rows"]:
            raise PackError(
                f"{out / PACK_STATE_NAME}: {entry['name']} records {entry['rows']} rows, {arrow} holds {found}; "
                f"pass {arg('overwrite', True)}"
            )
    state["plans"], state["shards"] = prev["plans"], prev["shards"]
    rows = sum(e["rows"] for e in state["shards"])
    _say(f"{out}: resuming after {len(state['shards'])} finished shard(s) at row {rows}")
    return state


def _check_disk_space(out: Path, src: SourceTokens, epochs: int) -> None:
    """Refuse (naming --epochs) an epoch count whose packed rows cannot fit the free space where they go: every
    epoch writes every token (its id and an int32 position) and per document piece its length, id and start, so
    `epochs * (tokens * (id bytes + 4) + documents * 20)` is a lower bound of the output (files already in the
    output folder, which a resume keeps, count as free)."""
    import shutil

    from balancer.data.pretokenize.summary import byte_size

    tokens = int(src.lengths.sum())
    need = epochs * (tokens * (src.dtype.itemsize + 4) + len(src.lengths) * 20)
    folder = out
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if out.is_dir() and not out.is_symlink():
        free += sum(f.stat().st_size for f in out.iterdir() if f.is_file() and not f.is_symlink())
    if need > free:
        raise PackError(
            f"{arg('epochs')} {epochs}: the packed rows need at least {byte_size(need)} ({epochs} epoch(s) of "
            f"{tokens:,} tokens at {src.dtype.itemsize + 4} bytes each, plus the per-document columns), more than "
            f"the {byte_size(free)} free on {folder}; lower {arg('epochs')} or free space"
        )


def _pack(src: SourceTokens, out: Path, topology, cost, epochs, seed, overflow, shard_tokens, overwrite, progress):
    check_fits(src, topology, overflow)
    _check_disk_space(out, src, epochs)
    job = _job_key(src, topology, cost, epochs, seed, {"overflow": overflow, "shard_tokens": shard_tokens})
    with open_output(out, [str(src.path)], "source"):
        status, prev, owned = prepare_pack_output(out, job, overwrite)
        if status == "complete":
            assert prev is not None, "the folder is complete: prev is its manifest"
            return _already_complete(out, prev)
        state = _resume_state(out, job, prev if status == "resume" else None)
        keep = {fn for e in state["plans"] + state["shards"] for fn in e["files"]}
        clear_owned(out, owned, keep=keep | {PACK_STATE_NAME, journal_path(out / PACK_STATE_NAME).name})
        plans = _write_all(out, src, topology, cost, (epochs, seed, overflow, shard_tokens), state, progress)
        manifest = _manifest(src, job, topology, cost, epochs, seed, overflow, shard_tokens, plans, state)
        _finish(out, manifest, src.dtype)
        c = manifest["counts"]
        _say(
            f"{out}: {c['rows']} rows ({c['rows'] // topology.dp} per DP rank), {c['tokens']} tokens, "
            f"{len(plans)} epoch(s), {len(manifest['shards'])} shard(s)"
        )
        for epoch, plan in enumerate(plans):
            if plan.last_micro_batches < topology.micro_batches:  # its rows: dp * M' in the last step
                _say(
                    f"epoch {epoch}: the last step runs {plan.last_micro_batches} of micro_batches = "
                    f"{topology.micro_batches} micro-batches per DP rank (the documents cannot fill it)"
                )
        return manifest


def _already_complete(out: Path, prev: dict) -> dict:
    """The finished folder's manifest, once every file verifies (a state and journal a kill left behind it gone)."""
    remove_state(out / PACK_STATE_NAME, lambda path: is_our_record(path, PACK))
    problems = verify_packed(out)
    if problems:
        raise PackError(
            f"{out} holds this job's output but it fails verification: {problems[0]}; pass {arg('overwrite', True)}"
        )
    _say(f"{out}: already complete ({prev['counts']['rows']} rows, {prev['counts']['tokens']} tokens)")
    return prev


def _write_all(out: Path, src: SourceTokens, topology, cost, options: tuple, state: dict, progress) -> list[Plan]:
    """Plan the epochs and write the rows after what `state` records (`options`: epochs, seed, overflow,
    shard_tokens), each file one line of the state's journal; the state is written whole at the start and once
    more, the journal folded in, when the run stops (removed instead when the planner refuses the first epoch)."""
    epochs, seed, overflow, shard_tokens = options
    run = JournaledState(out / PACK_STATE_NAME, state)
    try:
        plans = _plans(out, src, topology, cost, epochs, seed, overflow, run)
        _write_rows(out, src, plans, run, shard_tokens, progress)
    except PackError:
        if not state["plans"]:  # the planner refused the topology: leave no trace of this run
            run.discard()
        else:
            run.abort()
        raise
    except BaseException:
        run.abort()
        raise
    run.compact()
    return plans


def _manifest(src, job, topology, cost, epochs, seed, overflow, shard_tokens, plans, state) -> dict:
    epochs_info = []
    for epoch, plan in enumerate(plans):
        name = plan_file_name(epoch)
        epochs_info.append(
            {
                "epoch": epoch,
                "seed": seed + epoch,
                "plan": name,
                "steps": plan.num_steps,
                "rows": rows_per_epoch(plan),
                "tokens": int((plan.end - plan.start).sum()),
                "metrics": plan.metrics(),
            }
        )
    src_m = src.manifest
    return {
        "format": PACK_FORMAT,
        "format_version": PACK_FORMAT_VERSION,
        "balancer_version": _version(),
        "job": job,
        "source": {
            "path": str(src.path),
            "manifest_sha256": sha256_file(src.path / MANIFEST_NAME),
            "rows": src.num_rows,
            "tokens": int(src.lengths.sum()),
            "tokenizer": src_m.get("tokenizer"),
        },
        "topology": topology.to_dict(),
        "cost_model": cost.to_dict(),
        "options": {"epochs": epochs, "seed": seed, "overflow": overflow, "shard_tokens": shard_tokens},
        "features": {f.name: str(f.type) for f in pack_features(src.dtype).arrow_schema},
        "epochs": epochs_info,
        "counts": {
            "rows": sum(e["rows"] for e in epochs_info),
            "tokens": sum(e["tokens"] for e in epochs_info),
            "dropped_tokens": sum(p.dropped_tokens for p in plans),
        },
        "plans": state["plans"],
        "shards": state["shards"],
    }


def _finish(out: Path, manifest: dict, dtype: np.dtype) -> None:
    """datasets metadata, then manifest.json (atomic, last), then drop the state file."""
    names = [s["name"] for s in manifest["shards"]]
    write_datasets_metadata(out, names, dtype, manifest["job"], pack_features(dtype), PACK_DESCRIPTION)
    atomic_write_json(out / MANIFEST_NAME, manifest)
    remove_state(out / PACK_STATE_NAME)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _version() -> str:
    from balancer import __version__

    return __version__
