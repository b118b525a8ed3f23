"""balancer pretokenize / verify / merge, ShardDataset and read_lengths: real Arrow files, a real locally trained
Hugging Face tokenizer, real subprocesses killed with SIGKILL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from support.data_files import dir_bytes, kill_at_progress, make_texts, train_hf_tokenizer, write_jsonl, write_parquet  # noqa: E402

from balancer import cli  # noqa: E402
from balancer.data.pretokenize.options import PretokenizeOptions
from balancer.data.pretokenize.pipeline import pretokenize
from balancer.data.shards.dataset import ShardDataset
from balancer.data.shards.errors import DataError
from balancer.data.shards.lengths import read_lengths
from balancer.data.shards.manifest import load_manifest
from balancer.data.shards.verify import verify

REPO = Path(__file__).resolve().parents[2]


def run(inputs, out, tokenizer="byte", **kw):
    """In-process pretokenize with options as keyword arguments."""
    opt_names = {"text_field", "max_length", "overflow", "add_eos", "on_error", "shard_tokens"}
    opts = PretokenizeOptions(**{k: v for k, v in kw.items() if k in opt_names})
    rest = {k: v for k, v in kw.items() if k not in opt_names}
    return pretokenize([str(i) for i in inputs], out, tokenizer=tokenizer, options=opts, progress=False, **rest)


def rows_of(folder) -> list[tuple[int, bytes]]:
    ds = ShardDataset(folder)
    return [(ds[i]["doc_id"], ds[i]["input_ids"].numpy().astype(np.int64).tobytes()) for i in range(len(ds))]


def reassemble(folder) -> dict[int, np.ndarray]:
    """doc_id -> concatenated ids of its windows (in order)."""
    ds = ShardDataset(folder)
    parts = defaultdict(list)
    for i in range(len(ds)):
        item = ds[i]
        parts[item["doc_id"]].append(item["input_ids"].numpy())
    return {d: np.concatenate(p) for d, p in parts.items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    texts = make_texts(300, seed=1)
    write_jsonl(d / "a.jsonl", texts[:200])
    write_parquet(d / "b.parquet", texts[200:280])
    txt = d / "docs"
    txt.mkdir()
    for j, t in enumerate(texts[280:]):
        (txt / f"{j:03d}.txt").write_text(t, encoding="utf-8")
    return d, texts


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory, corpus):
    return train_hf_tokenizer(tmp_path_factory.mktemp("tok") / "bpe", corpus[1][:100])


# ---------------------------------------------------------------------------------------------------------------


def test_byte_round_trip_windows_and_readers(corpus, tmp_path):
    d, texts = corpus
    out = tmp_path / "out"
    m = run([d / "a.jsonl", d / "b.parquet", d / "docs"], out, max_length=97, shard_tokens=20_000)
    assert len(m["shards"]) > 3
    docs = reassemble(out)
    assert sorted(docs) == list(range(len(texts)))
    for i, t in enumerate(texts):
        assert docs[i].astype(np.uint8).tobytes() == t.encode("utf-8"), i
    ds = ShardDataset(out)
    assert ds.lengths.max() <= 97 and ds.lengths.dtype == np.int64
    assert np.array_equal(ds.lengths, [len(ds[i]["input_ids"]) for i in range(len(ds))])
    assert np.all(np.diff(ds.doc_ids) >= 0)
    assert ds[0]["input_ids"].dtype == torch.long
    assert np.array_equal(read_lengths(out), ds.lengths)
    assert m["counts"]["tokens"] == sum(len(t.encode()) for t in texts) == int(ds.lengths.sum())
    # the whole folder loads with datasets, and one shard alone
    import datasets

    whole = datasets.load_from_disk(str(out))
    assert len(whole) == len(ds)
    j = len(ds) // 2
    assert whole[j]["input_ids"] == ds[j]["input_ids"].tolist() and whole[j]["doc_id"] == ds[j]["doc_id"]
    one = datasets.Dataset.from_file(str(out / "shard-00001.arrow"))
    assert one.num_rows == m["shards"][1]["rows"]
    assert verify(out) == []


@pytest.mark.slow  # worker processes: ~16 s
def test_hf_tokenizer_matches_own_encoding_and_num_proc(corpus, hf_tok, tmp_path):
    from transformers import AutoTokenizer

    d, texts = corpus
    tok = AutoTokenizer.from_pretrained(str(hf_tok))
    m1 = run([d / "a.jsonl"], tmp_path / "p1", tokenizer=str(hf_tok), add_eos=True, shard_tokens=5_000)
    docs = reassemble(tmp_path / "p1")
    for i, t in enumerate(texts[:200]):
        assert docs[i].tolist() == tok(t)["input_ids"] + [tok.eos_token_id], i
    assert m1["tokenizer"]["vocab_size"] == len(tok) and m1["tokenizer"]["dtype"] == "uint16"
    # same tokenizer from a copied folder: same hash; 2 worker processes: byte-identical files
    m2 = run([d / "a.jsonl"], tmp_path / "p2", tokenizer=str(hf_tok), add_eos=True, shard_tokens=5_000, num_proc=2)
    assert m2["tokenizer"]["hash"] == m1["tokenizer"]["hash"]
    assert dir_bytes(tmp_path / "p1") == dir_bytes(tmp_path / "p2")


@pytest.mark.slow  # worker processes
def test_deterministic_and_num_proc_byte_tokenizer(corpus, tmp_path):
    d, _ = corpus
    args = ([d / "a.jsonl", d / "docs"],)
    run(*args, tmp_path / "r1", max_length=50, add_eos=True, shard_tokens=10_000)
    run(*args, tmp_path / "r2", max_length=50, add_eos=True, shard_tokens=10_000)
    run(*args, tmp_path / "r3", max_length=50, add_eos=True, shard_tokens=10_000, num_proc=2)
    a = dir_bytes(tmp_path / "r1")
    assert a == dir_bytes(tmp_path / "r2") == dir_bytes(tmp_path / "r3")
    assert len([n for n in a if n.endswith(".arrow")]) > 3


def test_overflow_modes(tmp_path):
    texts = ["a" * 10, "b" * 25, "c" * 3]
    src = write_jsonl(tmp_path / "x.jsonl", texts)
    m = run([src], tmp_path / "split", max_length=8)
    assert ShardDataset(tmp_path / "split").lengths.tolist() == [8, 2, 8, 8, 8, 1, 3]
    assert ShardDataset(tmp_path / "split").doc_ids.tolist() == [0, 0, 1, 1, 1, 1, 2]
    assert m["counts"]["split_documents"] == 2 and m["counts"]["tokens"] == 38
    m = run([src], tmp_path / "trunc", max_length=8, overflow="truncate", add_eos=True)
    ds = ShardDataset(tmp_path / "trunc")
    assert ds.lengths.tolist() == [8, 8, 4] and ds[2]["input_ids"].tolist() == [99, 99, 99, 256]
    assert m["counts"]["truncated_documents"] == 2 and m["counts"]["truncated_tokens"] == 3 + 18
    m = run([src], tmp_path / "drop", max_length=8, overflow="drop")
    assert ShardDataset(tmp_path / "drop").doc_ids.tolist() == [2]
    assert m["counts"]["skipped"] == {"too_long": 2} and m["counts"]["dropped_tokens"] == 35
    for name in ("split", "trunc", "drop"):
        assert verify(tmp_path / name) == []


def test_bad_input_fails_naming_file_and_line(tmp_path, capsys):
    good = json.dumps({"text": "fine"})
    bad_json = write_jsonl(tmp_path / "ok.jsonl", ["x"])  # placeholder replaced below
    bad_json.write_text("\n".join([good, good, '{"text": "unterminated', good]) + "\n")
    with pytest.raises(DataError, match=r"ok\.jsonl line 3: invalid JSON"):
        run([bad_json], tmp_path / "o1")
    assert not (tmp_path / "o1" / "manifest.json").exists()

    missing = tmp_path / "missing.jsonl"
    missing.write_text("\n".join([good, json.dumps({"body": "no text"})]) + "\n")
    with pytest.raises(DataError, match=r"missing\.jsonl line 2: no text field 'text'"):
        run([missing], tmp_path / "o2")

    undecodable = tmp_path / "bad.txt"
    undecodable.write_bytes(b"line one\nline two ok\n" + b"caf\xe9 latin-1\n")
    with pytest.raises(DataError, match=r"bad\.txt: line 3: invalid UTF-8"):
        run([undecodable], tmp_path / "o3")
    # same through the CLI: exit code 2 and the message on stderr, no manifest
    code = cli.main(["pretokenize", str(undecodable), "--output", str(tmp_path / "o4")])
    assert code == 2 and "bad.txt: line 3: invalid UTF-8" in capsys.readouterr().err
    assert not (tmp_path / "o4" / "manifest.json").exists()

    notext = tmp_path / "notext.parquet"
    write_parquet(notext, ["a", "b"], field="body")
    with pytest.raises(DataError, match=r"notext\.parquet row 0: no text field"):
        run([notext], tmp_path / "o5")


def test_skip_mode_counts_by_reason_and_empty_documents(tmp_path, capsys):
    lines = [
        json.dumps({"text": "one"}),
        "not json",
        json.dumps({"other": 1}),
        json.dumps({"text": ""}),
        "",
        json.dumps({"text": 5}),
        json.dumps([1, 2]),
        json.dumps({"text": "\ud800 lone surrogate"}),
        json.dumps({"text": "two"}),
    ]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    txt = tmp_path / "bad.txt"
    txt.write_bytes(b"\xff\xfe")
    empty_txt = tmp_path / "empty.txt"
    empty_txt.write_bytes(b"")
    # empty documents are skipped (and counted) even in fail mode
    m = run([empty_txt], tmp_path / "e")
    assert m["counts"]["skipped"] == {"empty": 1} and m["counts"]["rows"] == 0
    code = cli.main(
        ["pretokenize", str(src), str(txt), str(empty_txt), "--output", str(tmp_path / "s"), "--on-error", "skip"]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "skipped:" in err and "bad_json=1" in err
    m = load_manifest(tmp_path / "s")
    assert m["counts"]["skipped"] == {
        "bad_json": 1,
        "missing_field": 1,
        "empty": 2,
        "blank_line": 1,
        "not_text": 1,
        "not_object": 1,
        "unencodable_text": 1,
        "invalid_utf8": 1,
    }
    assert m["counts"]["records"] == len(lines) + 2 and m["counts"]["documents"] == 2
    assert {r["where"] for r in m["skipped_records"]} >= {f"{src} line 2", f"{txt}"}
    ds = ShardDataset(tmp_path / "s")
    assert ds.doc_ids.tolist() == [0, 8]  # doc_id = source record index
    assert bytes(ds[1]["input_ids"].tolist()) == b"two"


def test_verify_catches_flipped_byte(corpus, tmp_path, capsys):
    d, _ = corpus
    out = tmp_path / "out"
    run([d / "a.jsonl"], out, shard_tokens=20_000)
    assert cli.main(["verify", str(out)]) == 0
    victim = out / "shard-00002.arrow"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", str(out)]) == 1
    assert "shard-00002.arrow: sha256 mismatch" in capsys.readouterr().err
    victim.write_bytes(bytes(data[: len(data) // 2]))  # truncated file
    assert any("shard-00002.arrow: size" in p for p in verify(out))
    # a resumed/re-run of the same job refuses to call the corrupt output complete
    with pytest.raises(DataError, match="fails verification"):
        run([d / "a.jsonl"], out, shard_tokens=20_000)


def test_output_folder_guard(corpus, tmp_path):
    d, _ = corpus
    out = tmp_path / "out"
    run([d / "a.jsonl"], out)
    run([d / "a.jsonl"], out)  # same job: already complete, no error
    with pytest.raises(DataError, match="different job"):
        run([d / "a.jsonl"], out, max_length=10)
    m = run([d / "a.jsonl"], out, max_length=10, overwrite=True)
    assert m["options"]["max_length"] == 10 and verify(out) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.md").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        run([d / "a.jsonl"], other)
    # an output folder inside an input directory is refused (--overwrite there could reach the user's files)
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "x.jsonl", ["abc", "de"])
    with pytest.raises(DataError, match="is inside the input"):
        run([data], data / "tok")
    assert sorted(os.listdir(data)) == ["x.jsonl"]
    with pytest.raises(DataError, match="no such file"):
        run([d / "nope.jsonl"], tmp_path / "x")


def test_num_shards_slices_and_merge_equal_single_run(corpus, tmp_path, capsys):
    d, _ = corpus
    inputs = [d / "a.jsonl", d / "b.parquet", d / "docs"]
    run(inputs, tmp_path / "single", max_length=64, shard_tokens=15_000)
    parts = []
    for i in range(3):
        p = tmp_path / f"part{i}"
        run(inputs, p, max_length=64, shard_tokens=15_000, num_shards=3, shard_index=i)
        parts.append(str(p))
    assert cli.main(["merge", parts[0], parts[1], "--output", str(tmp_path / "bad")]) == 2
    assert "missing slice(s) [2]" in capsys.readouterr().err
    assert cli.main(["merge", parts[2], parts[0], parts[1], "--output", str(tmp_path / "merged")]) == 0
    assert verify(tmp_path / "merged") == []
    assert rows_of(tmp_path / "merged") == rows_of(tmp_path / "single")
    single, merged = load_manifest(tmp_path / "single"), load_manifest(tmp_path / "merged")
    assert merged["counts"] == single["counts"] and merged["job"] == single["job"]


def test_hf_dataset_folder_input(corpus, tmp_path):
    import datasets

    _, texts = corpus
    ds = datasets.Dataset.from_dict({"content": texts[:50]})
    ds.save_to_disk(str(tmp_path / "saved"))
    m = run([tmp_path / "saved"], tmp_path / "out", text_field="content")
    assert m["inputs"][0]["kind"] == "hf_disk" and m["counts"]["documents"] == 50
    docs = reassemble(tmp_path / "out")
    assert all(docs[i].astype(np.uint8).tobytes() == t.encode() for i, t in enumerate(texts[:50]))


def test_json_array_and_json_lines_files_and_ignored_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.json").write_text(json.dumps([{"text": "first"}, {"text": "sécond"}]))
    (data / "b.json").write_text(json.dumps({"text": "third"}) + "\n" + json.dumps({"text": "fourth"}) + "\n")
    (data / "notes.md").write_text("not an input")
    m = run([data], tmp_path / "out", num_shards=2, shard_index=1)
    assert [i["kind"] for i in m["inputs"]] == ["json_array", "jsonl"]
    assert m["ignored_files"] == [str(data / "notes.md")] and m["slice"]["records"] == [2, 4]
    ds = ShardDataset(tmp_path / "out")
    assert ds.doc_ids.tolist() == [2, 3] and bytes(ds[1]["input_ids"].tolist()) == b"fourth"
    m = run([data / "a.json"], tmp_path / "out2")
    assert bytes(ShardDataset(tmp_path / "out2")[1]["input_ids"].tolist()) == "sécond".encode()
    (data / "c.json").write_text('[{"text": "x"}, oops]')
    with pytest.raises(DataError, match=r"c\.json line 1 column 17: invalid JSON"):
        run([data / "c.json"], tmp_path / "out3")


@pytest.mark.slow  # DataLoader worker processes
def test_shard_dataset_with_dataloader(corpus, tmp_path):
    d, texts = corpus
    out = tmp_path / "out"
    run([d / "a.jsonl"], out, max_length=200, shard_tokens=10_000)
    ds = ShardDataset(out)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=2)
    got = [(item["doc_id"], item["input_ids"]) for item in loader]
    assert len(got) == len(ds)
    assert all(torch.equal(a[1], ds[i]["input_ids"]) and a[0] == ds[i]["doc_id"] for i, a in enumerate(got))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_read_lengths_formats(tmp_path):
    np.save(tmp_path / "l.npy", np.array([3, 1, 2], dtype=np.int32))
    assert read_lengths(tmp_path / "l.npy").tolist() == [3, 1, 2]
    (tmp_path / "l.json").write_text("[5, 6]")
    assert read_lengths(tmp_path / "l.json").tolist() == [5, 6]
    (tmp_path / "d.json").write_text('{"lengths": [7]}')
    assert read_lengths(tmp_path / "d.json").tolist() == [7]
    (tmp_path / "bad.json").write_text('["a"]')
    with pytest.raises(ValueError, match="bad.json"):
        read_lengths(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="manifest"):
        read_lengths(tmp_path)
    trace = REPO.parent / "shared" / "data" / "length_traces" / "wlbllm.json"
    if trace.exists():
        assert len(read_lengths(trace)) == 99_519


def test_help_explains_every_option():
    res = subprocess.run(
        [sys.executable, "-m", "balancer", "pretokenize", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    for opt in (
        "--output",
        "--tokenizer",
        "--text-field",
        "--max-length",
        "--overflow",
        "--add-eos",
        "--num-proc",
        "--on-error",
        "--shard-tokens",
        "--num-shards",
        "--shard-index",
        "--overwrite",
    ):
        assert opt in res.stdout


@pytest.mark.slow
def test_kill9_and_resume_byte_identical(tmp_path):
    """SIGKILL a real `pretokenize` process at random moments, rerun the same command each time: the final folder
    equals an uninterrupted run's byte for byte."""
    src = write_jsonl(tmp_path / "big.jsonl", make_texts(16000, seed=7, max_words=600))

    def cmd(out):
        return [
            sys.executable,
            "-m",
            "balancer",
            "pretokenize",
            str(src),
            "--output",
            str(out),
            "--max-length",
            "500",
            "--add-eos",
            "--shard-tokens",
            "300000",
        ]

    ref = tmp_path / "ref"
    subprocess.run(cmd(ref), cwd=REPO, check=True, capture_output=True)
    n_shards = len(load_manifest(ref)["shards"])
    assert n_shards >= 10
    out = tmp_path / "out"
    logs = kill_at_progress(cmd(out), out, ".pretokenize-state.json", ref, stretches=4, seed=1234)
    done = subprocess.run(cmd(out), cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    logs.append(done.stderr)
    resumed = [int(x) for log in logs for x in re.findall(r"resuming after (\d+) finished shard", log)]
    assert any(0 < k < n_shards for k in resumed), logs  # some kill landed between shards of the writing phase
    assert dir_bytes(out) == dir_bytes(ref)
    assert verify(out) == []
