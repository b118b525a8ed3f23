"""Sampler inputs: document lengths from arrays, pretokenized folders, `ShardDataset`s or `datasets.Dataset`
columns, and the lengths fingerprint a resume state is checked against."""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import numpy as np

from balancer.planning.units import validate_lengths


def resolve_lengths(lengths, dataset=None) -> tuple[np.ndarray, Optional[int]]:
    """Lengths from an array/list, a pretokenized folder or lengths file path, a `ShardDataset` (`.lengths`), a
    `datasets.Dataset` (its `input_ids` column), or a column name of `dataset`. Returns (lengths, dataset size)."""
    src = lengths
    if isinstance(src, (str, os.PathLike)):
        if dataset is not None and isinstance(src, str) and _is_hf_dataset(dataset) and src in dataset.column_names:
            arr = np.asarray(_hf_column(dataset, src))
            if arr.dtype == object or arr.ndim != 1:  # a list column (e.g. input_ids): lengths of its rows
                arr = np.asarray(_hf_list_lengths(dataset, src))
        else:
            from balancer.data.shards.lengths import read_lengths

            arr = read_lengths(src)
    elif hasattr(src, "lengths") and not isinstance(src, np.ndarray):  # ShardDataset and alike
        arr = np.asarray(src.lengths)
        if dataset is None:
            dataset = src
    elif _is_hf_dataset(src):
        if "input_ids" not in src.column_names:
            raise ValueError(
                f"the datasets.Dataset has no 'input_ids' column (columns: {src.column_names}); pass "
                "lengths='<column>', dataset=ds or a lengths array"
            )
        arr = np.asarray(_hf_list_lengths(src, "input_ids"))
        if dataset is None:
            dataset = src
    else:
        arr = np.asarray(src)
    arr = validate_lengths(arr)
    n_ds = None
    if dataset is not None:
        n_ds = len(dataset)
        if n_ds != len(arr):
            raise ValueError(
                f"lengths has {len(arr)} entries but the dataset has {n_ds} items: the lengths do not match the dataset"
            )
    return arr, n_ds


def _is_hf_dataset(x) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, datasets.Dataset)


def _hf_column(ds, name: str):
    tbl = ds.with_format("arrow")[:]
    return tbl.column(name).to_numpy(zero_copy_only=False)


def _hf_list_lengths(ds, name: str) -> np.ndarray:
    import pyarrow.compute as pc

    tbl = ds.with_format("arrow")[:]
    return pc.list_value_length(tbl.column(name)).to_numpy(zero_copy_only=False).astype(np.int64)


def fingerprint_lengths(lengths: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:32]
