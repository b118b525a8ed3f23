"""merge and pack record their progress in the run state's journal (balancer/data/shards/journal.py), as pretokenize
does: the state file is written at the start of a run and once more when it stops, each file finished appends its
checksummed lines. A kill between journal writes (after a shard's pending line, before its shard line) or inside an
append resumes to the bytes of an uninterrupted run, after the shards the journal records; a state the previous code
wrote (no journal) still resumes; an edit of a journal line with a matching checksum is still caught (pack refuses
it against the disk; merge redoes the shards from the first one that differs from what the parts give)."""

from __future__ import annotations

import json
import os
import re
import signal
import zlib
from pathlib import Path

import pytest
from support.data_files import dir_bytes
from support.reliability import copy_folder, in_child, tokenize

from balancer.data.pack.verify import verify_packed
from balancer.data.pretokenize.merge import merge
from balancer.data.shards.errors import DataError
from balancer.data.shards.journal import StateJournal, journal_path
from balancer.data.shards.verify import verify

MERGE_STATE, PACK_STATE = ".pretokenize-state.json", ".pack-state.json"
PACK_ARGS = ["--dp", "2", "--micro-batches", "2", "--max-tokens", "4096", "--epochs", "2", "--shard-tokens", "4000"]


def _cli(*argv):
    from balancer.cli import main

    return lambda: main([str(a) for a in argv])


@pytest.fixture(scope="module")
def parts(tmp_path_factory, src) -> list[Path]:
    root = tmp_path_factory.mktemp("parts")
    for i in range(2):
        tokenize([src], root / f"p{i}", num_shards=2, shard_index=i)
    return [root / "p0", root / "p1"]


@pytest.fixture(scope="module")
def merged(tmp_path_factory, parts) -> Path:
    """An uninterrupted merge: the bytes every resumed merge must end with."""
    out = tmp_path_factory.mktemp("merged") / "m"
    merge([str(p) for p in parts], out)
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory, ref) -> Path:
    """An uninterrupted pack of `ref` (two epochs, ~26 shards): the bytes every resumed pack must end with."""
    out = tmp_path_factory.mktemp("packed") / "p"
    assert _cli("pack", ref, *PACK_ARGS, "-q", "--output", out)() == 0
    return out


def _runs(command: str, parts: list[Path], ref: Path, out: Path):
    """(the command writing `out` as a function, its state file's name, a check of the finished folder)."""
    if command == "merge":
        return _cli("merge", *parts, "--output", out), MERGE_STATE, verify
    return _cli("pack", ref, *PACK_ARGS, "-q", "--output", out), PACK_STATE, verify_packed


def _kill_at(monkeypatch, key: str, nth: int, half: bool) -> None:
    """SIGKILL the (child) run exactly before its `nth` journal record of `key` ("shard", "plan"), or in the middle
    of writing it (`half`: a line without its newline)."""
    real_write = StateJournal._write
    seen = []

    def write(self, record):
        if key in record:
            seen.append(1)
            if len(seen) == nth:
                if half:
                    os.write(self.fd, b"%08x %s" % (0, json.dumps(record).encode()[:40]))
                os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, record)

    monkeypatch.setattr(StateJournal, "_write", write)


def _state_writes(monkeypatch, name: str) -> list[str]:
    """Every rename onto the state file `name` (how atomic_write_json replaces it), collected in a list."""
    writes, real = [], os.replace

    def replace(source, dest, *a, **k):
        if os.path.basename(str(dest)) == name:
            writes.append(name)
        return real(source, dest, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    return writes


@pytest.mark.parametrize("command", ["merge", "pack"])
def test_the_state_is_written_at_the_start_and_the_end_not_per_shard(command, parts, ref, tmp_path, monkeypatch):
    out = tmp_path / "out"
    work, state, _ = _runs(command, parts, ref, out)
    writes = _state_writes(monkeypatch, state)
    assert work() == 0
    monkeypatch.undo()
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) >= 10
    assert len(writes) == 2  # the shards (and plans) went to the journal
    assert not (out / state).exists() and not journal_path(out / state).exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, key, nth, half",
    [
        ("merge", "shard", 4, False),  # shard 3 renamed and pending in the journal, its shard line not yet written
        ("merge", "shard", 4, True),  # inside that append
        ("pack", "plan", 2, False),  # epoch 1's plan renamed, not yet recorded
        ("pack", "shard", 6, False),
        ("pack", "shard", 6, True),
    ],
)
def test_a_kill_between_journal_writes_resumes_to_the_same_bytes(
    command, key, nth, half, parts, ref, merged, packed, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    work, state, check = _runs(command, parts, ref, out)
    _kill_at(monkeypatch, key, nth, half)
    assert in_child(work, tmp_path / "err") == -signal.SIGKILL, (tmp_path / "err").read_text()
    monkeypatch.undo()
    assert journal_path(out / state).exists()
    assert in_child(work, tmp_path / "err2") == 0, (tmp_path / "err2").read_text()
    want = merged if command == "merge" else packed
    assert dir_bytes(out) == dir_bytes(want) and check(out) == []
    resumed = re.findall(r"resuming after (\d+) (?:linked|finished) shard", (tmp_path / "err2").read_text())
    assert resumed == [str(nth - 1) if key == "shard" else "0"]  # the shards the journal recorded were kept


def _unfinished(command: str, parts, ref, tmp_path, monkeypatch) -> tuple[Path, str]:
    """A run killed before its 5th shard record (4 shards in its journal)."""
    out = tmp_path / "unfinished"
    work, state, _ = _runs(command, parts, ref, out)
    _kill_at(monkeypatch, "shard", 5, False)
    assert in_child(work, tmp_path / "kill") == -signal.SIGKILL, (tmp_path / "kill").read_text()
    monkeypatch.undo()
    return out, state


def _edit_journal(path: Path, index: int, change) -> None:
    """Apply `change` to the `index`-th shard record of the journal and give the line a matching checksum."""
    lines = path.read_bytes().split(b"\n")
    at = [i for i, line in enumerate(lines) if line[9:19] == b'{"shard":{'][index]
    record = json.loads(lines[at][9:])
    change(record["shard"])
    body = json.dumps(record, separators=(",", ":")).encode()
    lines[at] = b"%08x %s" % (zlib.crc32(body), body)
    path.write_bytes(b"\n".join(lines))


@pytest.mark.slow
def test_pack_refuses_a_consistent_edit_of_its_journal(parts, ref, tmp_path, monkeypatch, capsys):
    out, state = _unfinished("pack", parts, ref, tmp_path, monkeypatch)
    _edit_journal(journal_path(out / state), 3, lambda s: s.update(rows=s["rows"] - 1))
    capsys.readouterr()
    assert _runs("pack", parts, ref, out)[0]() == 2
    assert re.search(r"\.pack-state\.json: shard-00003 records \d+ rows, .* holds", capsys.readouterr().err)


@pytest.mark.slow
def test_merge_redoes_the_shards_from_a_consistent_edit_of_its_journal(parts, merged, tmp_path, monkeypatch, capsys):
    out, state = _unfinished("merge", parts, None, tmp_path, monkeypatch)
    unfinished_merge = copy_folder(out, tmp_path / "unfinished-copy")
    _edit_journal(journal_path(out / state), 2, lambda s: s.update(rows=s["rows"] - 1))
    capsys.readouterr()
    merge([str(p) for p in parts], out)
    assert "resuming after 2 linked shard(s)" in capsys.readouterr().err  # shard 2 differs from its part's: redone
    assert dir_bytes(out) == dir_bytes(merged) and verify(out) == []
    # a recorded shard whose files are gone: linked again, with the shards after it
    out = copy_folder(unfinished_merge, tmp_path / "gone")
    (out / "shard-00001.doc_ids.npy").unlink()
    capsys.readouterr()
    merge([str(p) for p in parts], out)
    assert "resuming after 1 linked shard(s)" in capsys.readouterr().err
    assert dir_bytes(out) == dir_bytes(merged) and verify(out) == []
    # an edit of a checksum: the file on disk is not the one recorded, so no run deletes or keeps it
    (tmp_path / "sha").mkdir()
    out, state = _unfinished("merge", parts, None, tmp_path / "sha", monkeypatch)
    _edit_journal(journal_path(out / state), 1, lambda s: s["files"]["shard-00001.arrow"].update(sha256="0" * 64))
    with pytest.raises(DataError, match=r"shard-00001\.arrow: recorded in \.pretokenize-state\.json but differs"):
        merge([str(p) for p in parts], out)


def _without_manifest(finished: Path, out: Path, keep_shards: int, prefix: str) -> None:
    """`finished` copied to `out` as a run killed after `keep_shards` shards left it (no manifest, no metadata)."""
    copy_folder(finished, out)
    for name in ("manifest.json", "state.json", "dataset_info.json"):
        (out / name).unlink()
    for f in out.iterdir():
        if f.name.startswith(prefix) and int(f.name[len(prefix) :].split(".")[0]) >= keep_shards:
            f.unlink()


def test_a_merge_state_of_the_previous_code_resumes(parts, merged, tmp_path):
    """The previous merge kept every linked shard as pending in a state file rewritten per shard, no journal."""
    out = tmp_path / "out"
    _without_manifest(merged, out, 5, "shard-")
    m = json.loads((merged / "manifest.json").read_text())
    pending = [{"name": s["name"], "files": s["files"]} for s in m["shards"][:5]]
    state = {"format": "balancer-pretokenize-state", "format_version": 2, "job": m["job"], "slice": None}
    (out / MERGE_STATE).write_text(json.dumps({**state, "shards": [], "pending": pending}))
    merge([str(p) for p in parts], out)
    assert dir_bytes(out) == dir_bytes(merged) and verify(out) == []


def test_a_pack_state_of_the_previous_code_resumes(parts, ref, packed, tmp_path, capsys):
    out = tmp_path / "out"
    _without_manifest(packed, out, 7, "shard-")
    m = json.loads((packed / "manifest.json").read_text())
    state = {"format": "balancer-pack-state", "format_version": 1, "job": m["job"], "plans": m["plans"]}
    (out / PACK_STATE).write_text(json.dumps({**state, "shards": m["shards"][:7]}))
    capsys.readouterr()
    assert _runs("pack", parts, ref, out)[0]() == 0
    assert "resuming after 7 finished shard(s)" in capsys.readouterr().err
    assert dir_bytes(out) == dir_bytes(packed) and verify_packed(out) == []


def test_merge_killed_after_its_manifest_leaves_no_state_behind(parts, merged, tmp_path):
    out = copy_folder(merged, tmp_path / "out")
    m = json.loads((merged / "manifest.json").read_text())
    state = {"format": "balancer-pretokenize-state", "format_version": 2, "job": m["job"], "slice": None}
    (out / MERGE_STATE).write_text(json.dumps({**state, "shards": m["shards"], "journal": "j"}))
    StateJournal(out / MERGE_STATE, "j").close()
    merge([str(p) for p in parts], out)  # already complete: the state and journal a kill left are removed
    assert dir_bytes(out) == dir_bytes(merged)


@pytest.mark.slow
def test_pretokenize_into_an_unfinished_merge_names_the_merge(parts, src, tmp_path, monkeypatch, capsys):
    out, _ = _unfinished("merge", parts, None, tmp_path, monkeypatch)
    capsys.readouterr()
    assert _cli("pretokenize", src, "--shard-tokens", "4000", "--output", out)() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unfinished `balancer merge`" in err[-1] and "--overwrite" in err[-1], err
