"""Nothing on disk is read loosely: manifests and run states are strict JSON (exact types, no unknown keys, known
format_version, ranges); `verify` refuses every folder a reader refuses, and more; hostile records and numbers
give one line naming the file, line or option, exit 2."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from support.data_files import make_texts, write_jsonl  # noqa: E402
from support.reliability import cli, copy_folder, edit_manifest, tokenize  # noqa: E402

import balancer  # noqa: E402
from balancer.data.pack.build import pack  # noqa: E402
from balancer.data.pack.verify import verify_packed  # noqa: E402
from balancer.data.shards.checks import open_folder  # noqa: E402
from balancer.data.shards.dataset import ShardDataset  # noqa: E402
from balancer.data.shards.errors import DataError  # noqa: E402
from balancer.data.shards.verify import verify  # noqa: E402

TOPO = balancer.Topology(dp=2, cp=1, micro_batches=2, max_tokens=2048)
COST = balancer.CostModel(attn_coef=1 / 3000, linear_coef=1.0)


@pytest.fixture(scope="module")
def good(tmp_path_factory, src) -> Path:
    out = tmp_path_factory.mktemp("good") / "tok"
    tokenize([src], out, max_length=700)
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory, good) -> Path:
    out = tmp_path_factory.mktemp("packed") / "out"
    pack(good, out, TOPO, COST, epochs=2, shard_tokens=20_000)
    return out


# ---------------------------------------------------------------------------------------------------- verify
@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m["shards"][1].update(first_doc_id=m["shards"][1]["first_doc_id"] + 1), "first/last doc_id"),
        (lambda m: m["shards"][0].update(max_length=m["shards"][0]["max_length"] - 1), "max_length"),
        (lambda m: m["tokenizer"].update(dtype="int32"), "dtype"),
        (lambda m: m["tokenizer"].update(vocab_size=100), "vocabulary"),
        (lambda m: m["tokenizer"].update(eos_id=2**63), "eos_id"),
    ],
)
def test_verify_fails_where_readers_refuse(good, tmp_path, capsys, change, match):
    bad = copy_folder(good, tmp_path / "bad")
    edit_manifest(bad, change)
    problems = verify(bad)
    assert problems and match in problems[0], problems
    code, err = cli(capsys, "verify", bad)
    assert code == 1 and err[0].startswith("FAIL") and "Traceback" not in "".join(err)


def test_verify_of_a_packed_folder_checks_the_topology_against_the_plans(packed, tmp_path, capsys):
    assert verify_packed(packed) == []
    bad = copy_folder(packed, tmp_path / "topo")
    edit_manifest(bad, lambda m: m["topology"].update(max_tokens=4096))
    problems = verify_packed(bad)
    assert problems and "disagrees with the manifest" in problems[0], problems
    for name, change, match in [
        ("epochs", lambda m: m["epochs"][1].update(seed=99), "epochs[1]"),
        ("order", lambda m: m["shards"].reverse(), "shards[0]"),
        ("outside", lambda m: m["plans"][0]["files"].update({"../x": m["plans"][0]["files"].popitem()[1]}), "plans"),
        ("no_shards", lambda m: m.pop("shards"), 'missing key "shards"'),
        ("string_bool", lambda m: m["options"].update(epochs="2"), '"options.epochs": expected an integer'),
    ]:
        bad = copy_folder(packed, tmp_path / name)
        edit_manifest(bad, change)
        problems = verify_packed(bad)
        assert problems and match in problems[0], (name, problems)
        code, err = cli(capsys, "verify", bad)
        assert code == 1 and "Traceback" not in "".join(err), err


# ---------------------------------------------------------------------------------------------------- strict JSON
@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m["options"].update(add_eos="false"), '"options.add_eos": expected true or false'),
        (lambda m: m["options"].update(add_eos=0), '"options.add_eos": expected true or false'),
        (lambda m: m["counts"].update(rows=True), '"counts.rows": expected an integer'),
        (lambda m: m["shards"][0].update(rows=2**64), '"shards[0].rows": expected an integer'),
        (lambda m: m["options"].update(max_lenght=5), 'unknown key (did you mean "max_length"?)'),
        (lambda m: m.update(format_version=7), "newer than this balancer reads"),
        (lambda m: m.update(format="balancer-pretokenised"), '"format": not a balancer-pretokenized file'),
        (lambda m: m["options"].update(max_length=2**40), '"options.max_length": expected an integer in'),
        (lambda m: m["shards"][0]["files"]["shard-00000.arrow"].update(bytes=-1), "bytes"),
    ],
)
def test_manifest_is_read_strictly(good, tmp_path, capsys, change, match):
    bad = copy_folder(good, tmp_path / "bad")
    edit_manifest(bad, change)
    with pytest.raises(DataError, match=rf"manifest.json: .*{__import__('re').escape(match)}"):
        ShardDataset(bad)
    code, err = cli(capsys, "plan", bad, "--dp", "2", "--max-tokens", "4096")
    assert code == 2 and len(err) == 1 and "manifest.json" in err[0], err


def test_non_utf8_and_non_json_manifest_is_one_line(good, tmp_path, capsys):
    bad = copy_folder(good, tmp_path / "bad")
    (bad / "manifest.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(DataError, match="manifest.json: not UTF-8 text"):
        open_folder(bad)
    code, err = cli(capsys, "verify", bad)
    assert code == 1 and len(err) == 2 and "not UTF-8" in err[0]


def test_state_is_read_strictly_on_resume(good, src, tmp_path):
    out = copy_folder(good, tmp_path / "out")
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").unlink()  # make it an unfinished run of the same job: only its state remains
    state = {
        "format": "balancer-pretokenize-state",
        "format_version": 1,
        "job": manifest["job"],
        "slice": None,
        "shards": [],
        "inputs": manifest["inputs"],
        "cursor_of_everything": 5,  # unknown key
    }
    (out / ".pretokenize-state.json").write_text(json.dumps(state))
    for name in os.listdir(out):  # only the state stays
        if name != ".pretokenize-state.json":
            (out / name).unlink()
    with pytest.raises(DataError, match=r"pretokenize-state.json: \"cursor_of_everything\": unknown key"):
        tokenize([src], out, max_length=700)


# ---------------------------------------------------------------------------------------------------- records
def test_hostile_jsonl_records_are_one_line_and_skippable(tmp_path, capsys):
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    giant = '{"text": "x", "n": ' + "9" * 5000 + "}"
    for name, line, what in [("deep", deep, "nested too deeply"), ("giant", giant, "more than 4300 digits")]:
        corpus = tmp_path / f"{name}.jsonl"
        corpus.write_text('{"text": "fine"}\n' + line + '\n{"text": "also fine"}\n')
        code, err = cli(capsys, "pretokenize", corpus, "--output", tmp_path / f"o_{name}")
        assert code == 2 and len(err) == 1 and f"{corpus} line 2: invalid JSON" in err[0] and what in err[0], err
        assert not (tmp_path / f"o_{name}" / "manifest.json").exists()
        code, err = cli(capsys, "pretokenize", corpus, "--output", tmp_path / f"s_{name}", "--on-error", "skip")
        assert code == 0, err
        counts = json.loads((tmp_path / f"s_{name}" / "manifest.json").read_text())["counts"]
        assert counts["skipped"] == {"bad_json": 1} and counts["documents"] == 2


def test_a_line_cut_inside_a_utf8_character_is_reported_as_truncated(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes('{"text": "fine"}\n{"text": "caf\u00e9'.encode()[:-1])  # the last character cut
    code, err = cli(capsys, "pretokenize", corpus, "--output", tmp_path / "o")
    assert code == 2 and len(err) == 1 and "line 2" in err[0] and "truncated" in err[0], err
    assert "invalid UTF-8" not in err[0]
    txt = tmp_path / "t.txt"
    txt.write_bytes("caf\u00e9".encode()[:-1])
    code, err = cli(capsys, "pretokenize", txt, "--output", tmp_path / "o2")
    assert code == 2 and "truncated" in err[0] and "invalid UTF-8" not in err[0], err


# ---------------------------------------------------------------------------------------------------- count flags
HUGE = "99999999999999999999"


@pytest.mark.parametrize("flag", ["--max-length", "--shard-tokens", "--num-proc", "--num-shards", "--shard-index"])
def test_huge_pretokenize_counts_are_one_line_naming_the_flag(src, tmp_path, capsys, flag):
    extra = (
        ["--num-shards", "2"] if flag == "--shard-index" else ["--shard-index", "0"] if flag == "--num-shards" else []
    )
    code, err = cli(capsys, "pretokenize", src, "--output", tmp_path / "o", flag, HUGE, *extra)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {flag} must be in [") and "digits" not in flag
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


@pytest.mark.parametrize("flag", ["--epochs", "--shard-tokens", "--seed", "--max-tokens", "--dp", "--micro-batches"])
def test_huge_pack_counts_are_one_line_naming_the_flag(good, tmp_path, capsys, flag):
    code, err = cli(capsys, "pack", good, "--output", tmp_path / "o", "--dp", "2", "--max-tokens", "4096", flag, HUGE)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {flag} must be in ["), err
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


def test_pack_api_names_arguments_and_cli_names_flags(good, tmp_path, capsys):
    small = balancer.Topology(dp=2, cp=1, micro_batches=2, max_tokens=256)
    with pytest.raises(DataError, match=r"pass overflow='split'.*raise max_tokens or cp"):
        pack(good, tmp_path / "api", small, COST)
    code, err = cli(capsys, "pack", good, "--output", tmp_path / "cli", "--dp", "2", "--max-tokens", "256")
    assert code == 2 and "pass --overflow split" in err[0] and "raise --max-tokens or --cp" in err[0], err
    with pytest.raises(DataError, match=r"^epochs must be in \[1, 10,000\]"):
        pack(good, tmp_path / "api", TOPO, COST, epochs=10**20)


def test_num_proc_is_clipped_to_the_records(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_texts(3, seed=1))
    code, err = cli(capsys, "pretokenize", corpus, "--output", tmp_path / "o", "--num-proc", "16")
    used = [int(n) for line in err for n in re.findall(r"using (\d+) worker process\(es\) of the 16 asked", line)]
    assert code == 0 and used and used[0] <= min(3, os.cpu_count() or 1), err


def test_pack_resume_reads_its_state_strictly_and_against_the_disk(packed, good, tmp_path):
    for name, change, match in [
        ("swapped", lambda s: s["shards"].reverse(), r"\.pack-state\.json: shards\[0\]"),
        ("row_gap", lambda s: s["shards"][-1].update(first_row=s["shards"][-1]["first_row"] + 1), "first_row"),
        ("string", lambda s: s["shards"][0].update(rows="3"), r'\.pack-state\.json: "shards\[0\]\.rows": expected an'),
        ("rows", lambda s: s["shards"][-1].update(rows=s["shards"][-1]["rows"] - 1), r"records \d+ rows, .* holds"),
    ]:
        out = copy_folder(packed, tmp_path / name)
        m = json.loads((out / "manifest.json").read_text())
        state = {"format": "balancer-pack-state", "format_version": 1, "job": m["job"]}
        state.update(plans=m["plans"], shards=m["shards"])
        change(state)
        (out / "manifest.json").unlink()
        (out / ".pack-state.json").write_text(json.dumps(state))
        with pytest.raises(DataError, match=match):
            pack(good, out, TOPO, COST, epochs=2, shard_tokens=20_000)


def test_non_utf8_tokenizer_config_is_one_line_naming_the_file(src, tmp_path, capsys):
    folder = tmp_path / "tok_config"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_bytes(b'{"model_max_length": 8}')
    (folder / "tokenizer.json").write_bytes(b"\xff\xfe{")
    code, err = cli(capsys, "pretokenize", src, "--output", tmp_path / "o", "--tokenizer", folder)
    assert code == 2 and len(err) == 1 and f"{folder / 'tokenizer.json'}: not UTF-8 text" in err[0], err
    assert not (tmp_path / "o").exists()
