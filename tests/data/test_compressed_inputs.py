"""Compressed inputs of `balancer pretokenize` (.gz / .zst): the same rows, record numbers, line numbers in errors
and resume as the uncompressed files; checksums over the compressed bytes; corrupt and truncated streams named by
file, line and decompressed offset."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import zstandard
from support.data_files import dir_bytes, make_texts, write_jsonl
from tqdm import tqdm

from balancer import cli
from balancer.data.pretokenize import compression
from balancer.data.pretokenize.options import PretokenizeOptions
from balancer.data.pretokenize.pipeline import pretokenize
from balancer.data.shards.dataset import ShardDataset
from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import load_manifest
from balancer.data.shards.verify import verify


def run(inputs, out, **kw):
    opt_names = {"text_field", "max_length", "overflow", "add_eos", "on_error", "shard_tokens"}
    opts = PretokenizeOptions(**{k: v for k, v in kw.items() if k in opt_names})
    rest = {k: v for k, v in kw.items() if k not in opt_names}
    return pretokenize([str(i) for i in inputs], out, options=opts, progress=False, **rest)


def rows_of(folder) -> list[tuple[int, bytes]]:
    ds = ShardDataset(folder)
    return [(ds[i]["doc_id"], ds[i]["input_ids"].numpy().astype(np.int64).tobytes()) for i in range(len(ds))]


def gz_members(data: bytes, parts: int = 3) -> bytes:
    """A multi-member gzip file (as `cat a.gz b.gz` makes)."""
    cut = [len(data) * i // parts for i in range(parts + 1)]
    return b"".join(gzip.compress(data[a:b], mtime=0) for a, b in zip(cut, cut[1:]))


def zst_frames(data: bytes, parts: int = 2) -> bytes:
    cut = [len(data) * i // parts for i in range(parts + 1)]
    cctx = zstandard.ZstdCompressor(write_checksum=True)
    return b"".join(cctx.compress(data[a:b]) for a, b in zip(cut, cut[1:]))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    texts = make_texts(400, seed=3)
    write_jsonl(d / "a.jsonl", texts[:300])
    (d / "b.json").write_text(json.dumps([{"text": t} for t in texts[300:390]]), encoding="utf-8")
    (d / "c.txt").write_text(texts[390], encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def packed(plain, tmp_path_factory):
    """The same three inputs, compressed (gzip members, zstd frames)."""
    d = tmp_path_factory.mktemp("packed")
    (d / "a.jsonl.gz").write_bytes(gz_members((plain / "a.jsonl").read_bytes()))
    (d / "b.json.zst").write_bytes(zst_frames((plain / "b.json").read_bytes()))
    (d / "c.txt.gz").write_bytes(gzip.compress((plain / "c.txt").read_bytes()))
    return d


def test_compressed_inputs_give_the_rows_of_the_uncompressed_ones(plain, packed, tmp_path):
    ref = run([plain / "a.jsonl", plain / "b.json", plain / "c.txt"], tmp_path / "ref", max_length=50)
    m = run([packed], tmp_path / "out", max_length=50)  # a directory: .gz / .zst files are found by suffix
    assert rows_of(tmp_path / "out") == rows_of(tmp_path / "ref")
    assert m["counts"] == ref["counts"] and verify(tmp_path / "out") == []
    assert [i["kind"] for i in m["inputs"]] == ["jsonl", "json_array", "txt"]
    for info, ref_info in zip(m["inputs"], ref["inputs"]):
        raw = Path(info["path"]).read_bytes()
        assert info["sha256"] == hashlib.sha256(raw).hexdigest() and info["size"] == len(raw)
        assert info["decompressed_size"] == ref_info["size"] and info["records"] == ref_info["records"]
    assert [i["compression"] for i in m["inputs"]] == ["gzip", "zstd", "gzip"]
    # slices start inside a compressed stream at the right line
    parts = []
    for i in range(3):
        parts.append(str(tmp_path / f"part{i}"))
        run([packed], parts[-1], max_length=50, num_shards=3, shard_index=i)
    assert cli.main(["merge", *parts, "--output", str(tmp_path / "merged")]) == 0
    assert rows_of(tmp_path / "merged") == rows_of(tmp_path / "ref")


def test_bad_record_line_numbers_match_the_uncompressed_file(tmp_path):
    good = json.dumps({"text": "fine"})
    text = "\n".join([good] * 5000 + ['{"text": "unterminated'] + [good] * 10) + "\n"
    (tmp_path / "x.jsonl.zst").write_bytes(zst_frames(text.encode(), parts=3))
    with pytest.raises(DataError, match=r"x\.jsonl\.zst line 5001: invalid JSON"):
        run([tmp_path / "x.jsonl.zst"], tmp_path / "o")
    assert not (tmp_path / "o" / "manifest.json").exists()


def _corrupt_error(path: Path, out: Path, capsys) -> tuple[int, int]:
    """Run the CLI on a corrupt input: exit 2, one line naming the file, the line and the decompressed offset."""
    code = cli.main(["pretokenize", str(path), "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    found = re.search(re.escape(str(path)) + r" line (\d+): corrupt \w+ stream at byte (\d+) of the decompressed", err)
    assert found, err
    assert not (out / "manifest.json").exists()
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("fmt", ["gzip", "zstd"])
def test_corrupt_and_truncated_streams_name_file_line_and_offset(fmt, tmp_path, capsys):
    data = "".join(json.dumps({"text": f"document {i} " + "x" * (i % 97)}) + "\n" for i in range(40000)).encode()
    raw = zst_frames(data, parts=1) if fmt == "zstd" else gzip.compress(data, mtime=0)
    suffix = ".jsonl.zst" if fmt == "zstd" else ".jsonl.gz"
    flipped = bytearray(raw)
    flipped[len(raw) * 2 // 3] ^= 0x5A
    cases = {"flipped": bytes(flipped), "truncated": raw[: len(raw) * 2 // 3]}
    for name, blob in cases.items():
        path = tmp_path / (name + suffix)
        path.write_bytes(blob)
        line, offset = _corrupt_error(path, tmp_path / f"out-{name}", capsys)
        assert 0 <= offset < len(data), (name, offset)
        assert line == data[:offset].count(b"\n") + 1, (name, line, offset)  # the line holding that byte
        if name == "truncated":  # everything decompressible was read: the break is past most of the data
            assert offset > len(data) // 3


@pytest.mark.slow  # ~5 s
def test_compressed_input_resumes_byte_identical(tmp_path, monkeypatch):
    """A run interrupted while reading a compressed input resumes at its cursor (inside the stream) and ends byte
    identical to an uninterrupted run."""
    src = write_jsonl(tmp_path / "big.jsonl", make_texts(3000, seed=5, max_words=300))
    packed = tmp_path / "big.jsonl.gz"
    packed.write_bytes(gzip.compress(src.read_bytes(), mtime=0))
    opts = dict(max_length=200, shard_tokens=60_000)
    run([packed], tmp_path / "ref", **opts)
    n_shards = len(load_manifest(tmp_path / "ref")["shards"])
    assert n_shards >= 6

    monkeypatch.setattr(compression, "RAW_CHUNK", 4096)
    raw_chunks = -(-packed.stat().st_size // 4096)  # the fingerprint pass reads them all once
    fills = {"n": 0}
    real_fill = compression.DecompressedReader._fill

    def interrupting_fill(self):
        fills["n"] += 1
        if fills["n"] == raw_chunks + 1 + raw_chunks // 2:  # half way through the writing pass
            raise KeyboardInterrupt
        real_fill(self)

    monkeypatch.setattr(compression.DecompressedReader, "_fill", interrupting_fill)
    with pytest.raises(KeyboardInterrupt):
        run([packed], tmp_path / "out", **opts)
    assert not (tmp_path / "out" / "manifest.json").exists()
    state = json.loads((tmp_path / "out" / ".pretokenize-state.json").read_text())
    assert 0 < len(state["shards"]) < n_shards
    monkeypatch.setattr(compression.DecompressedReader, "_fill", real_fill)
    run([packed], tmp_path / "out", **opts)
    assert dir_bytes(tmp_path / "out") == dir_bytes(tmp_path / "ref") and verify(tmp_path / "out") == []


def test_unsupported_compressed_types_are_refused(tmp_path):
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress(b"x"))
    with pytest.raises(DataError, match=r"unsupported input type '\.parquet\.gz'.*optionally \.gz or \.zst"):
        run([tmp_path / "t.parquet.gz"], tmp_path / "o")
    corpus = tmp_path / "corpus"  # a folder input; the output must lie outside it
    corpus.mkdir()
    (tmp_path / "t.parquet.gz").rename(corpus / "t.parquet.gz")
    (corpus / "notes.gz").write_bytes(gzip.compress(b"x"))
    (corpus / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n'))
    m = run([corpus], tmp_path / "o2")
    assert sorted(Path(f).name for f in m["ignored_files"]) == ["notes.gz", "t.parquet.gz"]
    assert m["counts"]["documents"] == 1


def test_progress_over_input_bytes_and_summary_line(packed, tmp_path, capsys):
    """The bar counts the (uncompressed) input bytes to 100%; the summary names documents, tokens and the byte and
    token rates; --quiet hides the bars, not the summary."""
    m = pretokenize([str(packed)], tmp_path / "shown", progress=True)
    err = capsys.readouterr().err
    bar = [line for line in re.split(r"[\r\n]", err) if line.startswith("pretokenize:")][-1]
    total = sum(i["decompressed_size"] for i in m["inputs"])
    size = tqdm.format_sizeof(total)
    assert "100%" in bar and f"{size}/{size}" in bar, (bar, total)
    c = m["counts"]
    unit = r"[\d.]+ (B|kB|MB|GB)"
    rates = rf"{unit} read in .* s \({unit}/s, [\d,]+ tokens/s\)"
    summary = rf"{c['documents']} documents, {c['rows']} rows, {c['tokens']} tokens .* {rates}"
    assert "(0.0 MB/s)" not in err  # a small input's rate in a unit that shows it
    assert re.search(summary, err), err
    code = cli.main(["pretokenize", str(packed), "--output", str(tmp_path / "quiet"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 0 and "pretokenize:" not in err and "hashing inputs" not in err and re.search(summary, err)
