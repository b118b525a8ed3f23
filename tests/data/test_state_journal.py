"""A pretokenize run records its shards in an append-only journal, not by rewriting its state: the state file is
written at the start of a run and once more when it stops by itself (the journal folded in), each shard appends two
checksummed lines. A line cut short by a kill is a record never
committed; a damaged line before the last is refused naming the file and line; a stale journal (another id) is
ignored; a kill at any point still resumes to the same bytes (the kill -9 tests of test_pretokenize.py and
test_reliability_output.py run the same paths)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from support.data_files import dir_bytes
from support.reliability import copy_folder, in_child, tokenize

from balancer.data.pretokenize import pipeline
from balancer.data.shards import journal
from balancer.data.shards.errors import DataError
from balancer.data.shards.journal import StateJournal, journal_path, read_journal, replay
from balancer.data.shards.verify import verify

STATE = ".pretokenize-state.json"


@pytest.fixture()
def unfinished(src, tmp_path, monkeypatch) -> Path:
    """A run stopped after its shards were recorded, before its manifest and before folding its journal into the
    state (as a kill leaves it)."""
    out = tmp_path / "out"

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "finish_output", stop)
    monkeypatch.setattr(pipeline._ShardRun, "compact", lambda self: self.run.journal.close())
    with pytest.raises(KeyboardInterrupt):
        tokenize([src], out)
    monkeypatch.undo()
    return out


def test_the_state_file_is_written_once_per_run_not_per_shard(src, tmp_path, monkeypatch):
    writes = []
    real = pipeline.atomic_write_json
    for module in (pipeline, journal):  # the run's state goes through journal.JournaledState
        monkeypatch.setattr(module, "atomic_write_json", lambda path, obj: writes.append(path.name) or real(path, obj))
    manifest = tokenize([src], tmp_path / "out")
    assert len(manifest["shards"]) >= 5
    assert writes.count(STATE) == 2  # at the start and when folding the journal in: the shards went to the journal


def test_a_run_that_stops_by_itself_leaves_one_self_contained_state(src, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "finish_output", stop)
    with pytest.raises(KeyboardInterrupt):
        tokenize([src], out)
    state = json.loads((out / STATE).read_text())
    assert len(state["shards"]) >= 5 and "journal" not in state and not journal_path(out / STATE).exists()


def test_the_journal_holds_the_shards_and_a_resume_reads_them(unfinished, src, ref):
    state = json.loads((unfinished / STATE).read_text())
    assert state["shards"] == []  # everything since the state was written is in the journal
    records = read_journal(unfinished / STATE, state["journal"])
    shards = [r["shard"] for r in records if "shard" in r]
    assert [s["name"] for s in shards] == [f"shard-{i:05d}" for i in range(len(shards))] and len(shards) >= 5
    tokenize([src], unfinished)
    assert dir_bytes(unfinished) == dir_bytes(ref) and verify(unfinished) == []


def test_a_last_line_cut_short_is_a_record_never_committed(unfinished, src, ref):
    path = journal_path(unfinished / STATE)
    whole = path.read_bytes()
    path.write_bytes(whole + b'1234abcd {"shard": {"na')  # an append a kill cut short
    state = json.loads((unfinished / STATE).read_text())
    assert read_journal(unfinished / STATE, state["journal"]) == read_journal_bytes(whole, unfinished, state)
    tokenize([src], unfinished)
    assert dir_bytes(unfinished) == dir_bytes(ref)


def read_journal_bytes(data: bytes, folder: Path, state: dict) -> list:
    other = folder.parent / "copy"
    other.mkdir(exist_ok=True)
    (other / STATE).write_text(json.dumps(state))
    journal_path(other / STATE).write_bytes(data)
    return read_journal(other / STATE, state["journal"])


def test_a_damaged_line_before_the_last_is_refused_naming_the_file_and_line(unfinished, src):
    path = journal_path(unfinished / STATE)
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"rows":', b'"rowz":', 1) if b'"rows":' in lines[2] else lines[2][:-1] + b"x"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=rf"{path.name}: line 3 is damaged"):
        tokenize([src], unfinished)


def test_a_stale_journal_of_another_id_is_ignored(tmp_path):
    state_path = tmp_path / STATE
    journal = StateJournal(state_path, "old")
    journal.append({"shard": {"name": "shard-00000"}})
    journal.close()
    assert read_journal(state_path, "old") == [{"shard": {"name": "shard-00000"}}]
    assert read_journal(state_path, "new") == []
    state = {"shards": [{"name": "a"}], "pending": [{"name": "b", "files": {}}]}
    assert replay(state, [{"shard": {"name": "b"}}], "x") == {"shards": [{"name": "a"}, {"name": "b"}]}
    with pytest.raises(DataError, match="record 2 is not a pending, shard or plan record"):
        replay(state, [{"other": 1}], "x")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after the state, before the journal", "inside a journal append"])
def test_a_kill_around_the_journal_resumes_to_the_same_bytes(unfinished, src, ref, tmp_path, monkeypatch, when):
    """Kill a resumed run right after it rewrote its state (the old journal still there, now stale), or a fresh run
    in the middle of a journal append (half a line written): the next run resumes to the same bytes."""
    if when == "after the state, before the journal":
        out = copy_folder(unfinished, tmp_path / "again")

        def init(self, *a, **k):
            os.kill(os.getpid(), signal.SIGKILL)

        monkeypatch.setattr(StateJournal, "__init__", init)
    else:
        out = tmp_path / "fresh"
        real_write = StateJournal._write
        calls = []

        def write(self, record):
            calls.append(1)
            if len(calls) == 3:  # the header, shard 0's pending record, then half of shard 0's record
                os.write(self.fd, b"%08x %s" % (0, json.dumps(record).encode()[:20]))
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(self, record)

        monkeypatch.setattr(StateJournal, "_write", write)
    assert in_child(lambda: tokenize([src], out) and 0, tmp_path / "err") == -signal.SIGKILL
    monkeypatch.undo()
    assert in_child(lambda: tokenize([src], out) and 0, tmp_path / "err2") == 0, (tmp_path / "err2").read_text()
    assert dir_bytes(out) == dir_bytes(ref) and verify(out) == []
