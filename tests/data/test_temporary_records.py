"""Temporary files are deleted only because a record of ours names them, never because of their name: a run records
each temporary name in its folder's lock file before it creates the file, and drops it once the file is renamed or
removed. A file with one of our temporary names that no record names survives every run (plain, resume,
--overwrite), which stops naming it; a run killed with SIGKILL between creating a temporary file and renaming it
leaves the name recorded, and the next run deletes exactly that file and resumes to the same bytes (pretokenize,
merge and pack)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from support.data_files import dir_bytes
from support.reliability import copy_folder, in_child, tokenize

from balancer.data.pretokenize.merge import merge
from balancer.data.shards.errors import DataError
from balancer.data.shards.output import LOCK_NAME, OutputLock, ownership, recorded_temporaries
from balancer.data.shards.verify import verify
from balancer.temporaries import note_temporary

STATE = ".pretokenize-state.json"


def _killed_before(target: str, work, err: Path, monkeypatch) -> None:
    """Run `work` in a child killed with SIGKILL exactly before the rename onto `target` (its temporary file exists)."""
    real_replace = os.replace

    def replace(source, dest, *a, **k):
        if os.path.basename(str(dest)) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(source, dest, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    try:
        assert in_child(work, err) == -signal.SIGKILL, err.read_text()
    finally:
        monkeypatch.setattr(os, "replace", real_replace)


def _cli(*argv):
    from balancer.cli import main

    return lambda: main([str(a) for a in argv])


def _lock_names(out: Path) -> set[str]:
    return set(json.loads((out / LOCK_NAME).read_text())["temporary"])


@pytest.fixture()
def killed(src, tmp_path, monkeypatch) -> Path:
    """A pretokenize run killed between writing shard 1's temporary files and renaming them."""
    out = tmp_path / "out"
    work = _cli("pretokenize", src, "--output", out, "--shard-tokens", 4000)
    _killed_before("shard-00001.arrow", work, tmp_path / "err", monkeypatch)
    return out


def test_a_kill_leaves_the_temporary_names_recorded_and_the_resume_deletes_exactly_them(killed, src, ref, tmp_path):
    left = {n for n in os.listdir(killed) if n.endswith(".tmp")}
    assert {"shard-00001.arrow.tmp", "shard-00001.lengths.npy.tmp", "shard-00001.doc_ids.npy.tmp"} <= left
    assert left <= _lock_names(killed)  # every temporary file there is recorded in the dead run's lock
    assert in_child(_cli("pretokenize", src, "--output", killed, "--shard-tokens", 4000), tmp_path / "e") == 0
    assert dir_bytes(killed) == dir_bytes(ref) and verify(killed) == []


@pytest.mark.parametrize("name", ["shard-00004.arrow.tmp", "shard-00007.lengths.npy.tmp", STATE + ".tmp"])
def test_an_unrecorded_file_with_our_temporary_name_survives_and_is_named(killed, src, tmp_path, name):
    assert name not in _lock_names(killed)
    (killed / name).write_text("the user's")  # a file with one of our temporary names that no record of ours names
    for overwrite in (False, True):
        with pytest.raises(DataError, match=rf"{name}: has a temporary name .*does not record it"):
            tokenize([src], killed, overwrite=overwrite)
        assert (killed / name).read_text() == "the user's"


def test_a_temporary_name_in_an_empty_folder_is_never_deleted(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / (STATE + ".tmp")).write_text("mine")  # the name of our state's temporary file, nothing recorded
    with pytest.raises(DataError, match=rf"{STATE}.tmp: has a temporary name"):
        tokenize([src], out, overwrite=True)
    assert sorted(os.listdir(out)) == [STATE + ".tmp"] and (out / (STATE + ".tmp")).read_text() == "mine"


def test_the_lock_records_a_name_before_the_file_exists_and_drops_it_after(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(out) as lock:
        note_temporary(out / "shard-00000.arrow.tmp", True)
        assert _lock_names(out) == {"shard-00000.arrow.tmp"} and not (out / "shard-00000.arrow.tmp").exists()
        assert recorded_temporaries(out) == {"shard-00000.arrow.tmp"} == lock.temporary
        note_temporary(out / "shard-00000.arrow.tmp", False)
        assert _lock_names(out) == set()
    assert not (out / LOCK_NAME).exists()


def test_a_lock_record_naming_a_path_outside_the_folder_is_not_ours(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "precious.tmp").write_text("keep")
    record = {"pid": 1, "host": "h", "started": "then", "temporary": ["../precious.tmp"]}
    (out / LOCK_NAME).write_text(json.dumps(record))
    with pytest.raises(DataError, match="not a lock file of this tool"):
        tokenize([src], out)
    assert (tmp_path / "precious.tmp").read_text() == "keep"


def test_a_recorded_name_that_the_lock_did_not_record_for_this_folder_stays(killed, tmp_path):
    """Ownership of a temporary file comes from the lock of its own folder, not from any other record."""
    other = copy_folder(killed, tmp_path / "other")
    (other / LOCK_NAME).unlink()
    assert recorded_temporaries(other) == set()
    own = ownership(other)
    assert {n for n in os.listdir(other) if n.endswith(".tmp")} <= set(own.disputed)


@pytest.mark.slow
def test_merge_killed_between_a_link_and_its_rename_resumes(src, tmp_path, monkeypatch):
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, p in enumerate(parts):
        tokenize([src], p, num_shards=2, shard_index=i)
    want = tmp_path / "want"
    merge([str(p) for p in parts], want)
    out = tmp_path / "merged"
    _killed_before("shard-00001.arrow", _cli("merge", *parts, "--output", out), tmp_path / "err", monkeypatch)
    assert "shard-00001.arrow.tmp" in os.listdir(out) and "shard-00001.arrow.tmp" in _lock_names(out)
    assert in_child(_cli("merge", *parts, "--output", out), tmp_path / "e") == 0, (tmp_path / "e").read_text()
    assert dir_bytes(out) == dir_bytes(want) and verify(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("target", ["shard-00000.arrow", "plan-epoch-00001.json.tmp", "plan-epoch-00000.json"])
def test_pack_killed_between_a_temporary_file_and_its_rename_resumes(ref, tmp_path, monkeypatch, target):
    args = ["pack", ref, "--dp", "2", "--micro-batches", "2", "--max-tokens", "4096", "--epochs", "2", "-q"]
    args += ["--shard-tokens", "4000", "--output"]
    want = tmp_path / "want"
    assert in_child(_cli(*args, want), tmp_path / "e0") == 0, (tmp_path / "e0").read_text()
    out = tmp_path / "out"
    _killed_before(target, _cli(*args, out), tmp_path / "err", monkeypatch)
    left = {n for n in os.listdir(out) if n.endswith(".tmp")}
    assert left and left <= _lock_names(out)  # Plan.save's random temporary name too
    assert in_child(_cli(*args, out), tmp_path / "e") == 0, (tmp_path / "e").read_text()
    assert dir_bytes(out) == dir_bytes(want)
