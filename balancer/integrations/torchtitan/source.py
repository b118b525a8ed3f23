"""Where a torchtitan loader's documents come from: a pretokenized folder (`balancer pretokenize`) or a Hugging Face
dataset, tokenized with the trainer's tokenizer when it holds text only.

`open_documents(...)` returns `(dataset, lengths)`: a map-style dataset whose item `i` is a dict with `input_ids`
(and `labels` when the source has them), and one token count per item for the planner.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import numpy as np

from balancer.data.shards.manifest import MANIFEST_NAME


def is_pretokenized(path: Optional[str]) -> bool:
    """True when `path` is a finished `balancer pretokenize` folder (its manifest is written last)."""
    return path is not None and bool(path) and (Path(path) / MANIFEST_NAME).is_file()


def open_documents(
    dataset: str,
    dataset_path: Optional[str],
    *,
    split: str,
    column: str,
    text_column: str,
    load_dataset_kwargs: dict,
    tokenizer: Any,
) -> tuple[Any, Any]:
    """(map-style dataset of dicts with `input_ids`, lengths): a pretokenized folder at `dataset_path`, else the
    Hugging Face dataset `dataset_path or dataset` (a `save_to_disk` folder or a `load_dataset` name / path, its
    `split`); a dataset without `column` but with `text_column` is tokenized with `tokenizer.encode(text,
    add_bos=True, add_eos=True)`, as torchtitan's own text loader does."""
    if dataset_path is not None and is_pretokenized(dataset_path):
        from balancer.data.shards.dataset import ShardDataset

        ds = ShardDataset(dataset_path)
        return ds, ds.lengths
    name = dataset_path or dataset
    if not name:
        raise ValueError("BalancedDataLoader.Config: set dataset_path (a pretokenized folder) or dataset (a Hugging "
                         "Face dataset name or path)")  # fmt: skip
    ds = _load_hf(name, split, load_dataset_kwargs)
    if column not in ds.column_names:
        ds = _tokenized(ds, name, column, text_column, tokenizer)
    keep = [c for c in (column, "labels") if c in ds.column_names]
    ds = ds.select_columns(keep)
    if column != "input_ids":
        ds = ds.rename_column(column, "input_ids")
    ds = ds.with_format("numpy")
    lengths = np.fromiter((len(x) for x in ds.with_format(None)["input_ids"]), dtype=np.int64, count=len(ds))
    return ds, lengths


def _load_hf(name: str, split: str, kwargs: dict):
    import datasets

    if os.path.isdir(name) and (Path(name) / "state.json").is_file():
        ds = datasets.load_from_disk(name)
    elif os.path.isdir(name) and (Path(name) / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(name)[split]
    else:
        ds = datasets.load_dataset(name, split=split, **kwargs)
    if not isinstance(ds, datasets.Dataset):
        raise ValueError(
            f"dataset {name!r}: a map-style datasets.Dataset is needed (the planner reads every length up front), got "
            f"{type(ds).__name__}; for a stream use balancer.BalancedStream"
        )
    return ds


def _tokenized(ds, name: str, column: str, text_column: str, tokenizer):
    if text_column not in ds.column_names:
        raise ValueError(
            f"dataset {name!r} has neither a {column!r} column (token ids) nor a {text_column!r} column (text): "
            f"columns {ds.column_names}"
        )
    if tokenizer is None:
        raise ValueError(f"dataset {name!r} holds text ({text_column!r}): the loader needs the trainer's tokenizer")

    def encode(row: dict) -> dict:
        return {column: tokenizer.encode(row[text_column], add_bos=True, add_eos=True)}

    return ds.map(encode, remove_columns=[c for c in ds.column_names if c != "labels"])
