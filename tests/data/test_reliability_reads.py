"""Reading a pretokenized folder never returns wrong data silently: tampered index files, swapped or missing shard
entries, wrong Arrow row counts and names that leave the folder (absolute, `..`, symlinks out) are refused on open
by ShardDataset and read_lengths, and by verify and merge, each naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
from support.reliability import copy_folder, edit_manifest, flip_byte, make_corpus, tokenize  # noqa: E402

from balancer.data.pretokenize.merge import merge
from balancer.data.shards.arrow_rows import stream_row_count  # noqa: E402
from balancer.data.shards.dataset import ShardDataset
from balancer.data.shards.errors import DataError  # noqa: E402
from balancer.data.shards.lengths import read_lengths
from balancer.data.shards.verify import verify


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("good")
    out = d / "tok"
    m = tokenize([make_corpus(d / "src")], out)
    assert len(m["shards"]) >= 3
    return out


@pytest.fixture(scope="module")
def slices(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("slices")
    src = make_corpus(d / "src", n=60)
    parts = [d / f"part{i}" for i in range(2)]
    for i, p in enumerate(parts):
        tokenize([src], p, shard_tokens=3000, num_shards=2, shard_index=i)
    return parts


def refused_everywhere(folder: Path, match: str) -> None:
    """ShardDataset, read_lengths and verify all refuse `folder` with a message matching `match`."""
    with pytest.raises(DataError, match=match):
        ShardDataset(folder)
    with pytest.raises(ValueError, match=match):
        read_lengths(folder)
    problems = verify(folder)
    assert problems and any(re.search(match, p) for p in problems), problems


def test_good_folder_opens_and_arrow_header_count_matches_pyarrow(good):
    ds = ShardDataset(good)
    assert len(ds) == json.loads((good / "manifest.json").read_text())["counts"]["rows"]
    assert np.array_equal(read_lengths(good), ds.lengths)
    ShardDataset(good, check="full")
    import pyarrow as pa

    for f in sorted(good.glob("*.arrow")):
        assert stream_row_count(f) == pa.ipc.open_stream(pa.memory_map(str(f))).read_all().num_rows


@pytest.mark.parametrize("batches", [0, 1, 5, 40])
def test_arrow_header_row_count_on_many_batches_and_damage(tmp_path, batches):
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.uint16())), ("doc_id", pa.int64())])
    path = tmp_path / "s.arrow"
    rng = np.random.default_rng(batches)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for _ in range(batches):
            n = int(rng.integers(1, 3000))
            ids = pa.array([[1, 2, 3]] * n, type=pa.list_(pa.uint16()))
            writer.write_batch(pa.RecordBatch.from_arrays([ids, pa.array(np.arange(n))], schema=schema))
    assert stream_row_count(path) == pa.ipc.open_stream(pa.memory_map(str(path))).read_all().num_rows
    data = path.read_bytes()
    from balancer.data.shards.arrow_rows import ArrowHeaderError

    for damaged in (data[:-5], data[:-5] + b"\0" * 5, b"\0" * len(data), data[: len(data) // 2]):
        path.write_bytes(damaged)
        with pytest.raises(ArrowHeaderError):
            stream_row_count(path)


@pytest.mark.parametrize("index", ["lengths", "doc_ids"])
def test_flipped_byte_in_an_index_file_is_refused_on_open(good, tmp_path, index):
    bad = copy_folder(good, tmp_path / "bad")
    flip_byte(bad / f"shard-00001.{index}.npy")
    refused_everywhere(bad, rf"shard-00001\.{index}\.npy: (checksum|sha256)")


def forge_checksums(folder: Path, name: str) -> None:
    """Record the current bytes of shard 0's file `name` in the manifest, as a forger would."""
    data = (folder / name).read_bytes()
    digests = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "crc32": zlib.crc32(data)}
    edit_manifest(folder, lambda m: m["shards"][0]["files"][name].update(digests))


def test_index_rewritten_with_matching_checksum_is_caught_by_consistency_or_full_check(good, tmp_path):
    """A permuted lengths index with its manifest checksum updated keeps sum and max: the cheap checks cannot see
    it, the full check (verify, check='full') does."""
    bad = copy_folder(good, tmp_path / "bad")
    path = bad / "shard-00000.lengths.npy"
    lengths = np.load(path)
    np.save(path, lengths[::-1].copy())
    forge_checksums(bad, "shard-00000.lengths.npy")
    with pytest.raises(DataError, match="lengths index differs"):
        ShardDataset(bad, check="full")
    assert any("lengths index differs" in p for p in verify(bad))
    # a changed total is caught on open
    np.save(path, lengths + 1)
    forge_checksums(bad, "shard-00000.lengths.npy")
    with pytest.raises(DataError, match="sums to"):
        ShardDataset(bad)


def test_swapped_shard_entries_are_refused(good, tmp_path):
    bad = copy_folder(good, tmp_path / "bad")
    edit_manifest(bad, lambda m: m["shards"].reverse())
    refused_everywhere(bad, r"shards\[0\].*expected 'shard-00000'")
    # the entries' data swapped, names kept: sizes and checksums no longer match
    bad2 = copy_folder(good, tmp_path / "bad2")

    def swap_data(m):
        a, b = m["shards"][0], m["shards"][1]
        for key in ("rows", "tokens", "max_length", "first_doc_id", "last_doc_id"):
            a[key], b[key] = b[key], a[key]

    edit_manifest(bad2, swap_data)
    with pytest.raises(DataError, match="shard-0000[01]"):
        ShardDataset(bad2)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m.update(shards=[]), "counts.rows"),
        (lambda m: m.pop("shards"), 'missing key "shards"'),
        (lambda m: m["shards"].pop(), "counts.rows"),
        (lambda m: m["shards"][0].pop("files"), 'missing key "files"'),
        (lambda m: m["shards"][0]["files"]["shard-00000.arrow"].update(sha256=None), "sha256"),
    ],
)
def test_missing_or_empty_shard_list_is_refused(good, tmp_path, change, match):
    bad = copy_folder(good, tmp_path / "bad")
    edit_manifest(bad, change)
    refused_everywhere(bad, match)


def test_arrow_row_count_checked_on_open(good, tmp_path):
    bad = copy_folder(good, tmp_path / "bad")
    # shard 1's Arrow file replaced by shard 2's, manifest size/checksum updated to match: wrong rows
    (bad / "shard-00001.arrow").write_bytes((good / "shard-00002.arrow").read_bytes())
    entry2 = json.loads((good / "manifest.json").read_text())["shards"][2]["files"]["shard-00002.arrow"]
    edit_manifest(bad, lambda m: m["shards"][1]["files"]["shard-00001.arrow"].update(entry2))
    with pytest.raises(DataError, match=r"shard-00001\.arrow: \d+ rows, manifest.json says"):
        ShardDataset(bad)
    # truncated Arrow file: size differs from the manifest
    bad2 = copy_folder(good, tmp_path / "bad2")
    data = (bad2 / "shard-00000.arrow").read_bytes()
    (bad2 / "shard-00000.arrow").write_bytes(data[:-100])
    refused_everywhere(bad2, r"shard-00000\.arrow: size")


def test_token_bytes_flipped_open_is_cheap_full_check_catches(good, tmp_path):
    bad = copy_folder(good, tmp_path / "bad")
    flip_byte(bad / "shard-00002.arrow", offset_from_end=200)
    assert len(ShardDataset(bad)) > 0  # the cheap open does not read token data (documented)
    with pytest.raises(DataError, match=r"shard-00002\.arrow.*sha256"):
        ShardDataset(bad, check="full")
    assert any("shard-00002.arrow" in p for p in verify(bad))


def _rename_in_manifest(folder: Path, old: str, new: str) -> None:
    def change(m):
        files = m["shards"][0]["files"]
        files[new] = files.pop(old)

    edit_manifest(folder, change)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_names_outside_the_folder_are_refused(good, tmp_path, kind):
    bad = copy_folder(good, tmp_path / "bad")
    outside = tmp_path / "outside.lengths.npy"
    outside.write_bytes((bad / "shard-00000.lengths.npy").read_bytes())  # identical bytes: checksums would pass
    if kind == "symlink":
        os.remove(bad / "shard-00000.lengths.npy")
        os.symlink(outside, bad / "shard-00000.lengths.npy")
        match = "resolves outside the folder"
    else:
        name = "../outside.lengths.npy" if kind == "dotdot" else str(outside)
        _rename_in_manifest(bad, "shard-00000.lengths.npy", name)
        match = "names files|not a plain name"
    refused_everywhere(bad, match)


def test_symlink_inside_the_folder_is_fine(good, tmp_path):
    ok = copy_folder(good, tmp_path / "ok")
    (ok / "sub").mkdir()
    os.replace(ok / "shard-00000.doc_ids.npy", ok / "sub" / "d.npy")
    os.symlink("sub/d.npy", ok / "shard-00000.doc_ids.npy")
    assert np.array_equal(ShardDataset(ok).doc_ids, ShardDataset(good).doc_ids)


def test_merge_never_links_a_file_from_outside_a_part(slices, tmp_path):
    parts = [copy_folder(p, tmp_path / p.name) for p in slices]
    secret = tmp_path / "secret.arrow"
    secret.write_bytes((parts[1] / "shard-00000.arrow").read_bytes())
    os.remove(parts[1] / "shard-00000.arrow")
    os.symlink(secret, parts[1] / "shard-00000.arrow")
    with pytest.raises(DataError, match="resolves outside the folder"):
        merge([str(p) for p in parts], tmp_path / "merged")
    assert not (tmp_path / "merged").exists() or not any((tmp_path / "merged").iterdir())
    # and a traversal name in a part's manifest
    parts2 = [copy_folder(p, tmp_path / f"{p.name}b") for p in slices]
    _rename_in_manifest(parts2[0], "shard-00000.arrow", "../secret.arrow")
    with pytest.raises(DataError, match="names files"):
        merge([str(p) for p in parts2], tmp_path / "merged2")
    os.remove(secret)
    merged = merge([str(p) for p in slices], tmp_path / "merged3")
    assert verify(tmp_path / "merged3") == [] and merged["counts"]["rows"] == len(ShardDataset(tmp_path / "merged3"))


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("a.txt", "100\n\n20\n", "a.txt:2: an empty line"),  # would shift every later document id
        ("a.txt", "1_000\n20\n", "a.txt:1: not an integer length: '1_000'"),
        ("a.txt", "\uff11\uff10\n20\n", "a.txt:1: not an integer length"),  # fullwidth digits
        ("a.txt", "+5\n20\n", "a.txt:1: not an integer length: '+5'"),
        ("a.json", '{"lengths": [1, 2], "lengths": [3]}', 'a.json: invalid JSON: key "lengths" appears twice'),
        ("a.json", "[1, NaN]", "a.json: invalid JSON: NaN is not a JSON number"),
    ],
)
def test_lengths_files_are_read_strictly(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError) as err:
        read_lengths(path)
    assert str(err.value).startswith(str(tmp_path / needle)), str(err.value)


def test_lengths_text_may_end_in_blank_lines_and_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("\ufeff7\r\n 8 \n\n\n", encoding="utf-8")
    assert read_lengths(path).tolist() == [7, 8]
