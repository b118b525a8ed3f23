"""Writing a pretokenized folder never destroys what the user owns and survives crashes and a second writer:
--overwrite deletes only files this tool provably wrote, never an input; an output that is, holds or lies in an input
is refused; a run killed at any rename (before the first state file, between a shard and its record, between the
manifest and the state removal) resumes to the same bytes; a lock keeps two writers apart."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from support.data_files import dir_bytes, make_texts, write_jsonl  # noqa: E402
from support.reliability import cli, copy_folder, in_child, start_child, tokenize, wait_child  # noqa: E402

from balancer.data.pretokenize.merge import merge
from balancer.data.shards.errors import DataError  # noqa: E402
from balancer.data.shards.output import LOCK_NAME, OutputLock  # noqa: E402
from balancer.data.shards.verify import verify


def test_overwrite_keeps_user_files_and_refuses_user_files_with_our_names(src, ref, tmp_path):
    out = copy_folder(ref, tmp_path / "out")  # a finished job of ours ...
    (out / "notes.tmp").write_text("mine")  # ... plus user files whose names we do not write
    (out / "README").write_text("mine")
    tokenize([src], out, max_length=50, overwrite=True)  # another job replaces ours
    assert (out / "notes.tmp").read_text() == "mine" and (out / "README").read_text() == "mine"
    assert verify(out) == []
    # user files carrying our names: never deleted, the run is refused naming one
    for name, content in [
        ("manifest.json", '{"mine": true}'),
        ("state.json", '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}'),
        ("dataset_info.json", '{"description": "my dataset"}'),
        ("shard-00000.arrow", "not arrow"),
        ("manifest.json.tmp", "half"),
    ]:
        user = tmp_path / f"user_{name}"
        user.mkdir()
        (user / name).write_text(content)
        with pytest.raises(DataError, match="not provably this tool"):
            tokenize([src], user, overwrite=True)
        assert sorted(os.listdir(user)) == [name] and (user / name).read_text() == content


def test_overwrite_deletes_nothing_a_foreign_manifest_names(src, tmp_path):
    """A folder whose manifest is not ours: the files it names are not deleted."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00000.arrow").write_text("user data")
    (out / "manifest.json").write_text(json.dumps({"format": "other", "job": "x", "shards": []}))
    with pytest.raises(DataError, match="not provably this tool"):
        tokenize([src], out, overwrite=True)
    assert (out / "shard-00000.arrow").read_text() == "user data"


@pytest.mark.parametrize("where", ["output_is_input", "input_inside_output", "output_inside_input"])
def test_output_related_to_an_input_is_refused(src, tmp_path, where):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "in.jsonl", make_texts(10, seed=2))
    before = dir_bytes(data)
    if where == "output_is_input":
        inputs, out = [data], data
    elif where == "input_inside_output":
        inputs, out = [data / "in.jsonl"], data
    else:
        inputs, out = [data], data / "tok"
    match = {"output_is_input": "is the input", "input_inside_output": "contains the input"}.get(where, "is inside")
    with pytest.raises(DataError, match=match):
        tokenize(inputs, out, overwrite=True)
    assert dir_bytes(data) == before and sorted(os.listdir(data)) == ["in.jsonl"]


def test_merge_output_that_is_a_part_is_refused(src, tmp_path):
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, p in enumerate(parts):
        tokenize([src], p, num_shards=2, shard_index=i)
    before = [dir_bytes(p) for p in parts]
    with pytest.raises(DataError, match="is the input"):
        merge([str(p) for p in parts], parts[0], overwrite=True)
    with pytest.raises(DataError, match="contains the input"):
        merge([str(p) for p in parts], tmp_path, overwrite=True)
    assert [dir_bytes(p) for p in parts] == before
    merge([str(p) for p in parts], tmp_path / "merged")
    assert verify(tmp_path / "merged") == []


# ---------------------------------------------------------------------------------------------------- crash windows
def _pretokenize_cli(src: Path, out: Path, shard_tokens: int = 4000):
    from balancer.cli import main

    return lambda: main(["pretokenize", str(src), "--output", str(out), "--shard-tokens", str(shard_tokens)])


@pytest.mark.slow
@pytest.mark.parametrize(
    "target",
    [
        ".pretokenize-state.json",  # before the first state file exists: used to refuse to resume
        "shard-00001.arrow",  # between shards
        "shard-00002.lengths.npy",  # inside one shard's commit
        "manifest.json",  # everything written but the manifest
    ],
)
def test_kill_before_a_rename_resumes_to_the_same_bytes(src, ref, tmp_path, target, monkeypatch):
    out = tmp_path / "out"
    real_replace = os.replace

    def replace(source, dest, *a, **k):  # a crash exactly before this rename (in the child only)
        if os.path.basename(str(dest)) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(source, dest, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    assert in_child(_pretokenize_cli(src, out), tmp_path / "err") == -signal.SIGKILL
    monkeypatch.setattr(os, "replace", real_replace)
    assert (out / LOCK_NAME).exists()  # the dead run's lock is left behind ...
    assert in_child(_pretokenize_cli(src, out), tmp_path / "err") == 0, (tmp_path / "err").read_text()
    assert dir_bytes(out) == dir_bytes(ref) and verify(out) == []  # ... and taken over


def test_kill_after_manifest_before_state_removal(src, ref, tmp_path):
    out = copy_folder(ref, tmp_path / "out")
    (out / ".pretokenize-state.json").write_text(json.dumps({"job": "j", "slice": None, "shards": []}))
    tokenize([src], out)  # same job, already complete: the stale state file is removed
    assert dir_bytes(out) == dir_bytes(ref)


# ---------------------------------------------------------------------------------------------------- the lock
def test_a_held_lock_refuses_a_second_writer_naming_it(src, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(out):
        with pytest.raises(DataError, match=rf"{LOCK_NAME}.*pid {os.getpid()}.*delete"):
            tokenize([src], out)
        code, err = cli(capsys, "pretokenize", src, "--output", out)
        assert code == 2 and len(err) == 1 and LOCK_NAME in err[0] and "Traceback" not in err[0]
    assert os.listdir(out) == []  # the refused runs wrote nothing; the lock is gone with its holder


def test_stale_lock_file_of_a_dead_process_is_taken_over(src, ref, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "started": "then"}))
    tokenize([src], out)
    assert dir_bytes(out) == dir_bytes(ref)


@pytest.mark.slow
def test_two_concurrent_writers(tmp_path):
    """Two processes started at the same instant into one folder: one writes, the other fails with one line naming
    the lock; the result verifies and holds no stray temporary file."""
    big = write_jsonl(tmp_path / "big.jsonl", make_texts(4000, seed=5, max_words=300))
    for attempt in range(3):  # both must reach the lock while the other holds it; retried if scheduling serialises
        out = tmp_path / f"out{attempt}"
        start_read, start_write = os.pipe()
        work = _pretokenize_cli(big, out, shard_tokens=200_000)
        pids = [start_child(work, tmp_path / f"e{i}", start_read) for i in range(2)]
        os.write(start_write, b"go")
        codes = [wait_child(pid) for pid in pids]
        os.close(start_read)
        os.close(start_write)
        if sorted(codes) == [0, 2]:
            break
    assert sorted(codes) == [0, 2], codes
    loser = (tmp_path / f"e{codes.index(2)}").read_text().strip().splitlines()
    assert len(loser) == 1 and LOCK_NAME in loser[0] and "pid" in loser[0], loser
    assert verify(out) == [] and not [n for n in os.listdir(out) if n.endswith(".tmp") or n == LOCK_NAME]
