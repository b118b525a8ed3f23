"""What a run may replace: never an input (`refuse_overwrite_of_inputs`), never a file of the user's that carries
one of our names (plain run, resume or --overwrite), never anything through a symlink; a resume trusts its state
only when it agrees with the shards on disk, and an input that changes is never called complete."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from support.data_files import dir_bytes, make_texts, write_jsonl  # noqa: E402
from support.reliability import cli, copy_folder, tokenize  # noqa: E402

from balancer.data.pretokenize import pipeline  # noqa: E402
from balancer.data.shards.errors import DataError  # noqa: E402
from balancer.data.shards.output import LOCK_NAME, refuse_overwrite_of_inputs  # noqa: E402
from balancer.data.shards.verify import verify  # noqa: E402

STATE = ".pretokenize-state.json"


@pytest.fixture(scope="module")
def unfinished(tmp_path_factory, src) -> Path:
    """The folder of a run stopped after recording every shard, before its manifest (a resumable state)."""
    out = tmp_path_factory.mktemp("unfinished") / "tok"
    real = pipeline.finish_output

    def stop(*a, **k):
        raise KeyboardInterrupt

    pipeline.finish_output = stop
    try:
        with pytest.raises(KeyboardInterrupt):
            tokenize([src], out)
    finally:
        pipeline.finish_output = real
    assert (out / STATE).exists() and not (out / "manifest.json").exists()
    return out


# ---------------------------------------------------------------------------------------------------- inputs
def test_refuse_overwrite_of_inputs_file_and_folder_cases(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lengths = data / "lengths.npy"
    lengths.write_bytes(b"x")
    (tmp_path / "link.npy").symlink_to(lengths)
    os.link(lengths, tmp_path / "hard.npy")
    names = ("-o", "LENGTHS")
    for output, inputs, match in [
        (lengths, [lengths], "is the input"),  # plan LENGTHS -o LENGTHS
        (tmp_path / "link.npy", [lengths], "is the input"),  # through a symlink
        (tmp_path / "hard.npy", [lengths], "is the input"),  # a hard link: the same file
        (data / "manifest.json", [data], "is inside the input"),  # plan tok -o tok/manifest.json
        (tmp_path, [lengths], "contains the input"),
    ]:
        with pytest.raises(DataError, match=match) as info:
            refuse_overwrite_of_inputs(output, inputs, names)
        assert str(info.value).startswith(f"-o {output}") and "(LENGTHS)" in str(info.value)
    refuse_overwrite_of_inputs(tmp_path / "plan.json", [lengths, "wlbllm"], names)  # fine; a name is no path
    assert lengths.read_bytes() == b"x"


def test_cli_names_flags_and_api_names_arguments(src, tmp_path, capsys):
    data = src.parent
    code, err = cli(capsys, "pretokenize", src, "--output", data)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --output {data} contains the input")
    assert "(INPUT)" in err[0]
    with pytest.raises(DataError, match=r"^output .* contains the input .* \(inputs\)"):
        tokenize([src], data)


# ---------------------------------------------------------------------------------------------------- user files
@pytest.mark.parametrize("name", ["dataset_info.json", "state.json", "shard-00005.arrow"])
def test_plain_resume_never_replaces_a_user_file_with_our_name(unfinished, tmp_path, src, name):
    out = copy_folder(unfinished, tmp_path / "out")
    if name == "shard-00005.arrow":  # a recorded shard replaced by the user's file of the same name
        (out / name).unlink()
    (out / name).write_text("my own file")
    for overwrite in (False, True):
        with pytest.raises(DataError, match=rf"{name}: .*not provably this tool"):
            tokenize([src], out, overwrite=overwrite)
        assert (out / name).read_text() == "my own file"


def test_overwrite_of_a_finished_job_deletes_no_unrecorded_shard_name(ref, src, tmp_path):
    out = copy_folder(ref, tmp_path / "out")
    (out / "shard-00099.arrow").write_text("mine")  # not recorded by the manifest: not ours
    with pytest.raises(DataError, match="shard-00099.arrow: has a name this tool writes"):
        tokenize([src], out, max_length=40, overwrite=True)
    assert (out / "shard-00099.arrow").read_text() == "mine"


# ---------------------------------------------------------------------------------------------------- symlinks
def test_lock_file_symlink_is_never_written_through(src, tmp_path, capsys):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(outside)
    code, err = cli(capsys, "pretokenize", src, "--output", out)
    assert code == 2 and len(err) == 1 and LOCK_NAME in err[0] and "symlink" in err[0]
    assert outside.read_text() == "keep me"


@pytest.mark.parametrize("name", ["manifest.json", "dataset_info.json", "shard-00000.arrow.tmp", STATE + ".tmp"])
def test_symlinks_with_our_names_are_refused_and_their_targets_untouched(ref, src, unfinished, tmp_path, name):
    outside = tmp_path / "outside"
    shutil_target = copy_folder(ref, outside)  # a real folder of ours elsewhere: its files look like ours
    target = shutil_target / ("manifest.json" if name.endswith(".tmp") else name)
    before = dir_bytes(outside)
    out = copy_folder(unfinished, tmp_path / "out")
    (out / name).symlink_to(target)
    for overwrite in (False, True):
        with pytest.raises(DataError, match=rf"{name}: .*not provably this tool"):
            tokenize([src], out, overwrite=overwrite)
    assert dir_bytes(outside) == before and (out / name).is_symlink()


# ---------------------------------------------------------------------------------------------------- resume
def _edit_state(folder: Path, change) -> None:
    state = json.loads((folder / STATE).read_text())
    change(state)
    (folder / STATE).write_text(json.dumps(state))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s["shards"].insert(1, s["shards"].pop(2)), r"shards\[1\] is 'shard-00002', expected 'shard-00001'"),
        (lambda s: s["shards"][2]["cursor"].update(record=s["shards"][2]["cursor"]["record"] + 3), "cursor"),
        (lambda s: s["shards"][2]["counters"].update(rows=1), "counters disagree"),
        (lambda s: s["shards"][0].update(first_doc_id=1), "first/last doc_id"),
    ],
)
def test_resume_refuses_a_state_that_disagrees_with_the_disk(unfinished, src, tmp_path, change, match):
    out = copy_folder(unfinished, tmp_path / "out")
    _edit_state(out, change)
    before = dir_bytes(out)
    with pytest.raises(DataError, match=rf"{STATE}: .*{match}"):
        tokenize([src], out)
    assert dir_bytes(out) == before  # nothing deleted or written


def test_resume_refuses_a_missing_recorded_shard(unfinished, src, tmp_path):
    out = copy_folder(unfinished, tmp_path / "out")
    (out / "shard-00001.doc_ids.npy").unlink()
    with pytest.raises(DataError, match=rf"{STATE}: shard-00001: .*shard-00001.doc_ids.npy.*missing"):
        tokenize([src], out)


def test_resume_after_the_state_check_is_byte_identical(unfinished, ref, src, tmp_path):
    out = copy_folder(unfinished, tmp_path / "out")
    tokenize([src], out)
    assert dir_bytes(out) == dir_bytes(ref) and verify(out) == []


@pytest.mark.parametrize("how", ["truncated", "grown", "edited (same size)"])
def test_an_input_changed_since_the_interrupted_run_is_named(tmp_path, how):
    data = tmp_path / "data"
    data.mkdir()
    corpus = data / "c.jsonl"
    texts = make_texts(60, seed=4, max_words=80)
    write_jsonl(corpus, texts)
    out = tmp_path / "out"
    real = pipeline.finish_output
    pipeline.finish_output = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    try:
        with pytest.raises(KeyboardInterrupt):
            tokenize([corpus], out, shard_tokens=2000)
    finally:
        pipeline.finish_output = real
    raw = corpus.read_bytes()
    changed = {"truncated": raw[:-50], "grown": raw + raw[:200], "edited (same size)": raw[:-2] + b"]\n"}[how]
    corpus.write_bytes(changed)
    expected = rf"different job.*{corpus} changed since the interrupted run: {re.escape(how)}"
    with pytest.raises(DataError, match=expected):
        tokenize([corpus], out, shard_tokens=2000)
    assert not (out / "manifest.json").exists()


def test_an_input_changing_while_read_never_ends_in_a_manifest(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_texts(80, seed=6, max_words=80))
    raw = corpus.read_bytes()
    real_close = pipeline._ShardRun.close_shard

    def close_and_truncate(self, cursor):  # after the first shard, the input loses its tail
        real_close(self, cursor)
        if len(self.shards) == 1:
            corpus.write_bytes(raw[: len(raw) // 2 + 7])  # cut inside a line

    monkeypatch.setattr(pipeline._ShardRun, "close_shard", close_and_truncate)
    for on_error in ("fail", "skip"):
        corpus.write_bytes(raw)
        out = tmp_path / f"out_{on_error}"
        with pytest.raises(DataError, match=rf"{corpus} changed while this run read it.*no manifest was written"):
            tokenize([corpus], out, shard_tokens=2000, on_error=on_error)
        assert not (out / "manifest.json").exists()


# ---------------------------------------------------------------------------------------------------- friction
def test_on_error_skip_after_a_failed_run_reuses_the_folder(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "unterminated')
    out = tmp_path / "tok"
    code, err = cli(capsys, "pretokenize", corpus, "--output", out)
    assert code == 2 and "line 3: invalid JSON (Unterminated string starting at column 10)" in err[0]
    assert "--on-error skip" in err[0] and "at at" not in err[0]
    code, err = cli(capsys, "pretokenize", corpus, "--output", out, "--on-error", "skip")
    assert code == 0, err
    assert any("reusing the folder" in line for line in err)
    assert verify(out) == [] and json.loads((out / "manifest.json").read_text())["counts"]["skipped"] == {"bad_json": 1}
    with pytest.raises(DataError, match=r"on_error='skip'"):  # the API names its argument
        tokenize([corpus], tmp_path / "api")
    assert dir_bytes(out)  # (the CLI run's folder is intact)


def test_a_state_written_before_format_version_still_resumes(unfinished, ref, src, tmp_path):
    out = copy_folder(unfinished, tmp_path / "out")
    _edit_state(out, lambda s: [s.pop(k) for k in ("format", "format_version", "inputs")])
    tokenize([src], out)
    assert dir_bytes(out) == dir_bytes(ref) and verify(out) == []


def test_an_unrecorded_next_shard_name_is_ours_only_when_pending_with_its_checksum(unfinished, src, ref, tmp_path):
    out = copy_folder(unfinished, tmp_path / "out")
    state = json.loads((out / STATE).read_text())
    nxt = f"shard-{len(state['shards']):05d}.arrow"
    (out / nxt).write_text("my own file")  # the name the next shard would get, not recorded anywhere
    with pytest.raises(DataError, match=rf"{nxt}: has a name this tool writes"):
        tokenize([src], out)
    assert (out / nxt).read_text() == "my own file"
    # the same name recorded as pending with its checksum (a run killed between a rename and its record) is ours
    import hashlib

    meta = {"bytes": (out / nxt).stat().st_size, "sha256": hashlib.sha256(b"my own file").hexdigest()}
    _edit_state(out, lambda s: s.update(pending=[{"name": nxt[:-6], "files": {nxt: meta}}]))
    tokenize([src], out)
    assert dir_bytes(out) == dir_bytes(ref)
