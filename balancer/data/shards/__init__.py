"""The pretokenized folder format, read and written by `pretokenize`, `merge` and `pack`.

On-disk layout of a folder (`balancer pretokenize ... --output DIR`)::

    DIR/shard-00000.arrow          Arrow IPC stream: input_ids list<uint16|int32>, doc_id int64 (one row per window)
    DIR/shard-00000.lengths.npy    int64 [rows]: tokens per row   (the lengths index: read without the tokens)
    DIR/shard-00000.doc_ids.npy    int64 [rows]: doc_id per row
    ...
    DIR/state.json, dataset_info.json   `datasets` metadata: `datasets.load_from_disk(DIR)` loads all shards as one
                                        Dataset; `datasets.Dataset.from_file(DIR/shard-00000.arrow)` loads one
    DIR/manifest.json              written last, atomically; its presence means the job is complete
    DIR/.pretokenize-state.json    progress while running (finished shards, input cursor); removed at the end

`doc_id` is the index of the source record in input order, counted over all inputs and over every record (also
the skipped ones); the windows of one split document share it. Modules: errors.py (`DataError`, OS errors),
manifest.py (names, manifest, crash-safe file helpers), arrow_rows.py, checks.py (open-time checks), verify.py
(every byte), lengths.py (the one lengths reader), dataset.py (`ShardDataset`), writer.py (one shard's files),
output.py (which files are provably ours, the folder lock).
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "DataError": "balancer.data.shards.errors",
    "describe_os_error": "balancer.data.shards.errors",
    "ShardDataset": "balancer.data.shards.dataset",
    "read_lengths": "balancer.data.shards.lengths",
    "load_manifest": "balancer.data.shards.manifest",
    "open_folder": "balancer.data.shards.checks",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
