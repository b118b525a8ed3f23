"""The `balancer pretokenize` pipeline: inputs -> encoder pool -> shards, resumable after a kill.

Shards close only at document boundaries, once they hold at least `shard_tokens` tokens, so boundaries depend only
on the inputs and the options. Each shard is written under a temporary name, fsynced, renamed, and then recorded
(with its checksums and the input cursor after it) in the state file, atomically. A new run with the same job
verifies the recorded shards by checksum, deletes everything else, and continues from the cursor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from balancer.data.pretokenize.options import PretokenizeOptions
from balancer.data.pretokenize.readers import (
    Cursor,
    _batched,
    cursor_for_record,
    fingerprint_input,
    input_bytes_read,
    iter_records,
    resolve_inputs,
)
from balancer.data.pretokenize.resume import (
    InputWatch,
    check_state_against_disk,
    describe_input_change,
    refuse_merge_state,
)
from balancer.data.pretokenize.summary import ProgressLines, log, summarize
from balancer.data.pretokenize.tokenize import (
    EncoderConfig,
    Tokenizer,
    TokenizerError,
    encode_payloads,
    init_encoder,
    load_tokenizer,
)
from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.journal import JournaledState, journal_path, load_state, remove_state
from balancer.data.shards.limits import check_count, usable_processes
from balancer.data.shards.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STATE_NAME,
    atomic_write_json,
)
from balancer.data.shards.output import (
    check_output_vs_inputs,
    clear_outputs,
    is_our_record,
    open_output,
    prepare_output,
)
from balancer.data.shards.schema import state_header
from balancer.data.shards.writer import ShardWriter, shard_features, write_datasets_metadata
from balancer.limits import MAX_NUM_PROC, MAX_NUM_SHARDS

MAX_SKIPPED_EXAMPLES = 100  # skipped records listed in the manifest (counts are always exact)
SKIP_REASONS = (
    "bad_json",
    "not_object",
    "missing_field",
    "not_text",
    "invalid_utf8",
    "truncated_utf8",
    "unencodable_text",
    "empty",
    "blank_line",
    "too_long",
)


# ----------------------------------------------------------------------------------------------------------------
# counters, log, summary


def new_counters() -> dict:
    """Zeroed run counters (the manifest's `counts`, plus the first skipped records)."""
    return {
        "records": 0,
        "documents": 0,
        "rows": 0,
        "tokens": 0,
        "skipped": {},
        "dropped_tokens": 0,
        "truncated_documents": 0,
        "truncated_tokens": 0,
        "split_documents": 0,
        "skipped_examples": [],
    }


def _note_skip(counters: dict, reason: str, doc_id: int, where: str, message: str) -> None:
    counters["skipped"][reason] = counters["skipped"].get(reason, 0) + 1
    if len(counters["skipped_examples"]) < MAX_SKIPPED_EXAMPLES:
        counters["skipped_examples"].append({"doc_id": doc_id, "where": where, "reason": reason, "message": message})


def finish_output(out: Path, manifest: dict, dtype: np.dtype) -> None:
    """datasets metadata, then manifest.json (atomic, last), then drop the state file."""
    names = [s["name"] for s in manifest["shards"]]
    if names:
        write_datasets_metadata(out, names, dtype, manifest["job"])
    atomic_write_json(out / MANIFEST_NAME, manifest)
    remove_state(out / STATE_NAME)


def _version() -> str:
    from balancer import __version__

    return __version__


# ----------------------------------------------------------------------------------------------------------------
# encoder pool (the per-batch work is tokenize.encode_payloads, importable without torch/datasets)


def _encode_stream(
    batches: Iterator[tuple[list, list]], cfg: EncoderConfig, tok: Tokenizer, num_proc: int
) -> Iterator[tuple[list, tuple]]:
    """(meta, encode result) per batch, in input order; `num_proc` > 1 encodes in that many spawn workers with at
    most 2 * num_proc batches in flight (bounded memory)."""
    if num_proc <= 1:
        init_encoder(cfg, tok)
        for meta, payloads in batches:
            yield meta, encode_payloads(payloads)
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(num_proc, initializer=init_encoder, initargs=(cfg,)) as pool:
        pending: deque = deque()
        for meta, payloads in batches:
            pending.append((meta, pool.apply_async(encode_payloads, (payloads,))))
            if len(pending) >= 2 * num_proc:
                m, r = pending.popleft()
                yield m, r.get()
        while pending:
            m, r = pending.popleft()
            yield m, r.get()


# ----------------------------------------------------------------------------------------------------------------
# the shard stream of one run


class _ShardRun:
    """Documents in, shards out: windows/truncates/drops per the options, closes a shard at the first document
    boundary past `shard_tokens`, and records each finished shard in the run state's journal (`run`)."""

    def __init__(self, out: Path, opts: PretokenizeOptions, tok: Tokenizer, run: JournaledState, counters: dict):
        self.out = out
        self.opts = opts
        self.dtype = tok.dtype
        self.schema = shard_features(tok.dtype).arrow_schema
        self.run = run  # a shard's record is one journal line: O(1)
        self.state = run.state
        self.shards: list[dict] = run.state["shards"]
        self.counters = counters
        self.writer: Optional[ShardWriter] = None

    def take_batch(self, meta: list, lengths: np.ndarray, flat: np.ndarray, errors: dict) -> None:
        """One encoded batch: `meta[j] = (doc_id, where, cursor after)`, `lengths[j] < 0` for a bad record."""
        offs = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.maximum(lengths, 0), out=offs[1:])
        for j, (doc_id, where, cur) in enumerate(meta):
            self.counters["records"] += 1
            n = int(lengths[j])
            if n < 0:
                reason, message = errors[j]
                if reason not in ("empty", "blank_line") and self.opts.on_error == "fail":
                    raise DataError(f"{where}: {message} (use {arg('on_error', 'skip')} to skip such records)")
                _note_skip(self.counters, reason, doc_id, where, message)
            else:
                self._take_document(flat[offs[j] : offs[j + 1]], doc_id, where)
            if self.writer is not None and self.writer.tokens >= self.opts.shard_tokens:
                self.close_shard(cur)

    def _take_document(self, ids: np.ndarray, doc_id: int, where: str) -> None:
        n, max_len = len(ids), self.opts.max_length
        if max_len is not None and n > max_len:
            if self.opts.overflow == "drop":
                _note_skip(self.counters, "too_long", doc_id, where, f"{n} tokens > --max-length {max_len}")
                self.counters["dropped_tokens"] += n
                return
            if self.opts.overflow == "truncate":
                self.counters["truncated_documents"] += 1
                self.counters["truncated_tokens"] += n - max_len
                ids = ids[:max_len]
            else:
                self.counters["split_documents"] += 1
        if self.writer is None:
            self.writer = ShardWriter(self.out, len(self.shards), self.schema, self.dtype)
        window = max_len or len(ids)
        for a in range(0, len(ids), window):
            self.writer.add(ids[a : a + window], doc_id)

    def close_shard(self, cursor: Cursor) -> None:
        """Finish the open shard and record it (with the input cursor after it) in the state file."""
        assert self.writer is not None
        entry = self.writer.close(before_rename=self._record_pending)
        self.writer = None
        self.counters["rows"] += entry["rows"]
        self.counters["tokens"] += entry["tokens"]
        self.counters["documents"] += entry["documents"]
        entry["cursor"] = cursor.to_json()
        entry["counters"] = json.loads(json.dumps(self.counters))
        self.run.record({"shard": entry})  # appended to `shards`, `pending` cleared

    def _record_pending(self, entry: dict) -> None:
        """The shard's files, checksummed, before they get their final names: what makes them provably ours
        should the run die between the renames and their record."""
        self.run.record({"pending": [{"name": entry["name"], "files": entry["files"]}]})

    def compact(self) -> None:
        """Fold the journal into the state file (`JournaledState.compact`: once per run)."""
        self.run.compact()

    def abort(self) -> None:
        """Remove the open shard's temporary files; the recorded shards and the state file stay (resumable)."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        self.run.abort()  # no space for the state: the journal stays, as valid as before


# ----------------------------------------------------------------------------------------------------------------
# pretokenize


def _check_args(opts: PretokenizeOptions, num_proc: int, num_shards: int, shard_index: int) -> None:
    opts.check()
    check_count("num_proc", num_proc, 1, MAX_NUM_PROC)
    check_count("num_shards", num_shards, 1, MAX_NUM_SHARDS)
    check_count("shard_index", shard_index, 0, num_shards - 1)


def _job_key(inputs: list[dict], tok: Tokenizer, opts: PretokenizeOptions) -> str:
    key = {
        "format": FORMAT_VERSION,
        "inputs": [[i["kind"], i["sha256"], i["records"]] for i in inputs],
        "tokenizer": tok.hash,
        "options": dataclasses.asdict(opts),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _hash_inputs(sources: list, disable: Optional[bool]) -> list[dict]:
    total_bytes = sum(os.path.getsize(s.path) for s in sources if s.kind not in ("hf_disk", "hf_hub"))
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="hashing inputs", disable=disable, file=sys.stderr
    ) as bar:
        return [fingerprint_input(s, bar) for s in sources]


def _slice_of(total_records: int, num_shards: int, shard_index: int) -> tuple[int, int, Optional[dict]]:
    """(first record, end record, the manifest's `slice`) of this run."""
    start = shard_index * total_records // num_shards
    end = (shard_index + 1) * total_records // num_shards
    if num_shards == 1:
        return start, end, None
    return start, end, {"num_shards": num_shards, "shard_index": shard_index, "records": [start, end]}


def _already_complete(out: Path, prev: dict) -> dict:
    from balancer.data.shards.verify import verify

    remove_state(out / STATE_NAME, is_our_record)  # killed between writing the manifest and removing the state
    problems = verify(out)
    if problems:
        raise DataError(
            f"{out} holds this job's finished output but it fails verification: {problems[0]}; delete the damaged "
            f"file(s) it names and pass {arg('overwrite', True)} to redo the job"
        )
    log(f"{out}: already complete ({prev['counts']['rows']} rows, {prev['counts']['tokens']} tokens)")
    return prev


def _resume_point(out: Path, prev: Optional[dict], cursor: Cursor) -> tuple[list[dict], dict, Cursor]:
    """(finished shards kept, counters after them, input cursor after them) of a resumed run; refuses a state
    that disagrees with the shards on disk."""
    counters = new_counters()
    if prev is None:
        return [], counters, cursor
    try:
        prev = load_state(out / STATE_NAME, "state")  # strict: exact types, no unknown keys; the journal applied
    except DataError:
        refuse_merge_state(out / STATE_NAME)
        raise
    check_state_against_disk(out, prev, cursor.record)
    shards = list(prev["shards"])
    if shards:
        cursor = Cursor.from_json(shards[-1]["cursor"])
        counters = json.loads(json.dumps(shards[-1]["counters"]))
    log(f"{out}: resuming after {len(shards)} finished shard(s) at record {cursor.record}")
    return shards, counters, cursor


def _check_inputs_unchanged(watch: InputWatch, sources, infos, read: int, expected: int, disable) -> None:
    """Before the manifest calls the output complete: every record was read, and the inputs are still the bytes
    hashed at the start (size, modification time, and a second sha256)."""
    change = watch.changed()
    if change is None and read != expected:
        change = f"the inputs yielded {read} records, {expected} were counted when they were hashed"
    if change is None:
        again = _hash_inputs(sources, disable)
        change = next(
            (
                f"input {a['path']} changed while this run read it (sha256 differs)"
                for a, b in zip(infos, again)
                if a["sha256"] != b["sha256"] or a["size"] != b["size"]
            ),
            None,
        )
    if change:
        raise watch.error(change)


def _manifest_of(
    run: _ShardRun, job: str, slice_, tok: Tokenizer, spec: str, infos: list, ignored: list, engine: dict
) -> dict:
    counters = run.counters
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "balancer_version": _version(),
        "job": job,
        "slice": slice_,
        "tokenizer": {**tok.describe(), "spec": spec},
        "options": dataclasses.asdict(run.opts),
        "inputs": infos,
        "ignored_files": ignored,
        "features": {"input_ids": f"list<{np.dtype(tok.dtype).name}>", "doc_id": "int64"},
        "counts": {k: v for k, v in counters.items() if k != "skipped_examples"},
        "skipped_records": counters["skipped_examples"],
        "shards": [{k: v for k, v in e.items() if k not in ("cursor", "counters")} for e in run.shards],
        "engine": engine,
    }


def _start_engine(engine: str, ray_address: Optional[str], announce: bool = True) -> dict:
    """Check the engine options (attaching to the Ray cluster); returns the manifest's `engine` entry."""
    if engine == "local":
        if ray_address is not None:
            raise DataError(f"{arg('ray_address')} needs {arg('engine', 'ray')}")
        return {"name": "local"}
    if engine != "ray":
        raise DataError(f"{arg('engine')} must be local or ray, got {engine!r}")
    from balancer.data.pretokenize import ray_engine

    started = time.perf_counter()
    if announce and ray_address is None:  # starting a local cluster takes seconds to a minute: say so first
        log("pretokenize: starting a local Ray cluster ...")
    ray_engine.connect(ray_address)  # a local cluster started here stays up for later calls in this process
    if announce:
        log(f"pretokenize: Ray ready after {time.perf_counter() - started:.1f} s")
    return ray_engine.describe(ray_address)


def _encoded_batches(engine: str, sources: list, infos: list, cursor: Cursor, end: int, cfg, tok, num_proc):
    """(meta, (lengths, flat ids, errors)) per batch from `cursor` to record `end`, in input order, from the
    local encoder pool or from Ray Data tasks: the same batches' records either way."""
    if engine == "ray":
        from balancer.data.pretokenize import ray_engine

        return ray_engine.encode_stream(sources, infos, cfg, cursor, end, num_proc)
    records = iter_records(sources, cfg.text_field, cursor, end)
    return _encode_stream(_batched(records), cfg, tok, num_proc)


def _stream(run: _ShardRun, batches: Iterator, infos: list, cursor: Cursor, end: int, n_inputs: int, disable):
    """Feed the encoded batches into `run` (a progress bar over the input bytes, or progress lines without a
    terminal); closes the last shard."""
    total, initial = input_bytes_read(Cursor(end, n_inputs, 0, None), infos), input_bytes_read(cursor, infos)
    lines = ProgressLines(total, initial, enabled=disable is None and not sys.stderr.isatty())
    bar = tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        desc="pretokenize",
        disable=disable,
        file=sys.stderr,
        smoothing=0.1,
    )
    try:
        for meta, (lengths, flat, errors) in batches:
            run.take_batch(meta, lengths, flat, errors)
            done = input_bytes_read(meta[-1][2], infos)
            bar.update(done - bar.n)
            lines.done, lines.documents = done, run.counters["documents"]
        if run.writer is not None:
            run.close_shard(Cursor(end, n_inputs, 0, None))
    except OSError as exc:  # Arrow's write errors carry the errno but no file name: name the shard
        shard = run.writer.tmp if run.writer is not None else None
        run.abort()
        if exc.filename is None and exc.errno and shard is not None:
            raise OSError(exc.errno, os.strerror(exc.errno), str(shard)) from exc
        raise
    except BaseException:
        run.abort()
        raise
    finally:
        lines.close()
        bar.close()


def pretokenize(
    inputs: Sequence[str],
    output: str | os.PathLike,
    tokenizer: str = "byte",
    options: Optional[PretokenizeOptions] = None,
    num_proc: int = 1,
    num_shards: int = 1,
    shard_index: int = 0,
    overwrite: bool = False,
    progress: Optional[bool] = None,
    engine: str = "local",
    ray_address: Optional[str] = None,
) -> dict:
    """Tokenize `inputs` into shards under `output`; returns the manifest. Resumes a killed run of the same job.

    Raises DataError for bad input (naming the file and line) when `on_error='fail'`, for a refused output
    folder, and for bad options; then no manifest is written. `progress=None` shows bars only on a terminal.
    `engine='ray'` tokenizes with Ray Data tasks on the cluster at `ray_address` (a local one when None): the same
    output, resume and checks as the local engine (only the manifest's `engine` entry differs)."""
    opts = options or PretokenizeOptions()
    _check_args(opts, num_proc, num_shards, shard_index)
    # before hashing: a wrong address fails fast
    engine_info = _start_engine(engine, ray_address, announce=progress is not False)
    t0 = time.perf_counter()
    out = Path(output)
    disable = None if progress is None else not progress
    check_output_vs_inputs(out, inputs)
    sources, ignored = resolve_inputs(list(inputs), exclude=out)
    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as exc:
        raise DataError(str(exc)) from exc
    if opts.add_eos and tok.eos_id is None:
        raise DataError(f"{arg('add_eos')}: tokenizer {tokenizer!r} has no eos_token")
    watch = InputWatch(sources)
    infos = _hash_inputs(sources, disable)
    job = _job_key(infos, tok, opts)
    start, end, slice_ = _slice_of(sum(i["records"] for i in infos), num_shards, shard_index)
    with open_output(out, inputs):
        status, prev, owned = prepare_output(
            out, job, slice_, overwrite, explain=lambda old: describe_input_change(old.get("inputs"), infos)
        )
        if status == "complete":
            assert prev is not None, "the folder is complete: prev is its manifest"
            return _already_complete(out, prev)
        shards, counters, cursor = _resume_point(out, prev, cursor_for_record(start, infos))
        keep = {fn for e in shards for fn in e["files"]} | {STATE_NAME, journal_path(out / STATE_NAME).name}
        clear_outputs(out, owned, keep=keep)
        state = {**state_header("state"), "job": job, "slice": slice_, "inputs": infos, "shards": shards}
        run = _ShardRun(out, opts, tok, JournaledState(out / STATE_NAME, state), counters)  # every shard so far
        cfg = EncoderConfig(tokenizer, tok.hash, opts.text_field, opts.add_eos)
        workers = num_proc if engine == "ray" else usable_processes(num_proc, end - cursor.record, log)
        batches = _encoded_batches(engine_info["name"], sources, infos, cursor, end, cfg, tok, workers)
        try:
            _stream(run, batches, infos, cursor, end, len(sources), disable)
        except DataError:  # a record cut by an input changing under us is not the input's fault: say what happened
            change = watch.changed()
            if change:
                raise watch.error(change) from None
            raise
        _check_inputs_unchanged(watch, sources, infos, run.counters["records"], end - start, disable)
        run.compact()
        manifest = _manifest_of(run, job, slice_, tok, tokenizer, infos, ignored, engine_info)
        finish_output(out, manifest, tok.dtype)
    summarize(out, manifest, time.perf_counter() - t0)
    return manifest
