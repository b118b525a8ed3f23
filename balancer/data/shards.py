"""Pretokenized shards: the names of `balancer pretokenize`, `verify` and `merge`, gathered in one place.

The code lives by concern: `pipeline` (the pretokenize run), `writer` (one shard's files), `output` (the output
folder), `manifest` (the on-disk format), `verify`, `merge`, `dataset` (`ShardDataset`, `read_lengths`) and
`readers` (the inputs). This module re-exports their public names.

On-disk layout of an output folder (`balancer pretokenize ... --output DIR`)::

    DIR/shard-00000.arrow          Arrow IPC stream: input_ids list<uint16|int32>, doc_id int64 (one row per window)
    DIR/shard-00000.lengths.npy    int64 [rows]: tokens per row   (the lengths index: read without the tokens)
    DIR/shard-00000.doc_ids.npy    int64 [rows]: doc_id per row
    ...
    DIR/state.json, dataset_info.json   `datasets` metadata: `datasets.load_from_disk(DIR)` loads all shards as one
                                        Dataset; `datasets.Dataset.from_file(DIR/shard-00000.arrow)` loads one
    DIR/manifest.json              written last, atomically; its presence means the job is complete
    DIR/.pretokenize-state.json    progress while running (finished shards, input cursor); removed at the end

`doc_id` is the index of the source record in input order, counted over all inputs and over every record (also
the skipped ones, so it points back to the source: the line of a .jsonl, the row of a parquet file or dataset, the
file of a .txt); the windows of one split document share it. Rows come out in input order.
"""

from __future__ import annotations

from .dataset import ShardDataset, read_lengths
from .manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STATE_NAME,
    atomic_write_json,
    load_manifest,
    shard_file_names,
)
from .merge import merge
from .pipeline import (
    DEFAULT_SHARD_TOKENS,
    MAX_SKIPPED_EXAMPLES,
    OVERFLOW_CHOICES,
    SKIP_REASONS,
    PretokenizeOptions,
    pretokenize,
)
from .readers import INPUT_SUFFIXES, READ_BATCH_BYTES, READ_BATCH_DOCS, InputSource, PretokenizeError, Record
from .verify import verify
from .writer import FLUSH_ROWS, FLUSH_TOKENS, ShardWriter, shard_features

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "FLUSH_ROWS",
    "FLUSH_TOKENS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INPUT_SUFFIXES",
    "MANIFEST_NAME",
    "MAX_SKIPPED_EXAMPLES",
    "OVERFLOW_CHOICES",
    "READ_BATCH_BYTES",
    "READ_BATCH_DOCS",
    "SKIP_REASONS",
    "STATE_NAME",
    "InputSource",
    "PretokenizeError",
    "PretokenizeOptions",
    "Record",
    "ShardDataset",
    "ShardWriter",
    "atomic_write_json",
    "load_manifest",
    "merge",
    "pretokenize",
    "read_lengths",
    "shard_features",
    "shard_file_names",
    "verify",
]
