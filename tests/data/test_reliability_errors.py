"""Every bad input, refused folder and operating-system failure of the data commands and of `plan` is one line
naming the file (and entry or option) and what to do, exit code 2, nothing half-written left behind."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from support.data_files import dir_bytes, make_texts, write_jsonl  # noqa: E402
from support.reliability import cli, edit_manifest, in_child, tokenize  # noqa: E402

from balancer.data.shards.verify import verify  # noqa: E402


def one_line(code: int, lines: list[str], *needles: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for needle in needles:
        assert needle in lines[0], (needle, lines)


def leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp") or n == ".balancer.lock")


# ---------------------------------------------------------------------------------------------------- plan inputs
def test_npz_without_lengths(tmp_path, capsys):
    np.savez(tmp_path / "l.npz", sizes=np.arange(1, 5))
    one_line(*cli(capsys, "plan", tmp_path / "l.npz", "--dp", "1"), "l.npz", "no 'lengths' array", "sizes")


def test_uint64_lengths_above_int64(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([5, 2**63 + 7, 3], dtype=np.uint64))
    one_line(*cli(capsys, "plan", tmp_path / "l.npy", "--dp", "1"), "l.npy[1]", "out of range")
    (tmp_path / "l.json").write_text(json.dumps([5, 2**64 + 1]))
    one_line(*cli(capsys, "stats", tmp_path / "l.json", "--no-plan"), "l.json[1]", "out of range")
    (tmp_path / "l.txt").write_text("4\n-3\n")
    one_line(*cli(capsys, "plan", tmp_path / "l.txt", "--dp", "1"), "l.txt[1]", "out of range")


@pytest.mark.parametrize("fill", ["nan", "inf", "0", "-0.5", "1.5"])
def test_bad_fill(tmp_path, capsys, fill):
    (tmp_path / "l.json").write_text("[100, 200, 300]")
    one_line(*cli(capsys, "plan", tmp_path / "l.json", "--dp", "1", "--fill", fill), "--fill")


def test_planning_an_empty_folder(src, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    one_line(*cli(capsys, "plan", tmp_path / "empty", "--dp", "1"), "empty", "no manifest.json")
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "", ""])  # every record empty: a folder of zero rows
    tokenize([blank], tmp_path / "zero")
    one_line(*cli(capsys, "plan", tmp_path / "zero", "--dp", "1"), "zero", "nothing to plan")
    one_line(*cli(capsys, "stats", tmp_path / "zero"), "zero", "nothing to plan")


def test_manifest_without_shard_list(ref, tmp_path, capsys):
    import shutil

    bad = Path(shutil.copytree(ref, tmp_path / "bad"))
    edit_manifest(bad, lambda m: m.pop("shards"))
    one_line(*cli(capsys, "plan", bad, "--dp", "1"), "manifest.json", 'missing key "shards"')
    code, lines = cli(capsys, "verify", bad)
    assert code == 1 and any('missing key "shards"' in x for x in lines), lines


# ---------------------------------------------------------------------------------------------------- OS errors
def test_not_a_directory(src, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line(*cli(capsys, "pretokenize", src, "--output", afile / "sub"), "afile/sub", "Not a directory")
    one_line(*cli(capsys, "pretokenize", src, "--output", afile), "afile", "not a directory")
    one_line(*cli(capsys, "merge", tmp_path, "--output", afile / "sub"), "manifest.json")


def _as_unprivileged(work, err: Path) -> tuple[int, list[str]]:
    """Run `work` as a user that file permissions apply to (root ignores them): a forked child that drops to
    `nobody` when we are root, else in a forked child as ourselves."""

    def child():
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        return work()

    code = in_child(child, err)
    return code, [x for x in err.read_text().splitlines() if x.strip()]


def test_unreadable_input_and_unwritable_output(src):
    from balancer.cli import main

    base = Path(tempfile.mkdtemp(prefix="rel-perm-"))
    try:
        os.chmod(base, 0o755)
        data = base / "in.jsonl"
        data.write_bytes(src.read_bytes())
        os.chmod(data, 0o000)
        out = base / "out"
        code, lines = _as_unprivileged(lambda: main(["pretokenize", str(data), "--output", str(out)]), base / "e1")
        one_line(code, lines, "in.jsonl", "Permission denied", "permissions")
        assert not out.exists()
        os.chmod(data, 0o644)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        os.chmod(locked, 0o555)
        target = locked / "out"
        code, lines = _as_unprivileged(lambda: main(["pretokenize", str(data), "--output", str(target)]), base / "e2")
        one_line(code, lines, "locked/out", "Permission denied")
        assert os.listdir(locked) == []
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_disk_full_injected_write_error_then_resume(src, ref, tmp_path, capsys, monkeypatch):
    """ENOSPC on the 6th fsync (inside a shard's commit): one line, no temporary file, the same command resumes."""
    real_fsync, calls = os.fsync, [0]

    def fsync(fd):
        calls[0] += 1
        if calls[0] == 6:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    out = tmp_path / "out"
    monkeypatch.setattr(os, "fsync", fsync)
    code, lines = cli(capsys, "pretokenize", src, "--output", out, "--shard-tokens", "4000")
    monkeypatch.setattr(os, "fsync", real_fsync)
    one_line(code, lines, "No space left on device", "run the same command again")
    assert leftovers(out) == []
    code, lines = cli(capsys, "pretokenize", src, "--output", out, "--shard-tokens", "4000")
    assert code == 0 and any("resuming after" in x for x in lines), lines
    assert dir_bytes(out) == dir_bytes(ref) and verify(out) == []


def test_disk_full_on_a_small_tmpfs_then_resume(tmp_path, capsys):
    """A real ENOSPC: output on a 192 KiB tmpfs (needs root to mount; skipped otherwise)."""
    big = write_jsonl(tmp_path / "big.jsonl", make_texts(400, seed=4, max_words=200))
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        out = mnt / "out"
        code, lines = cli(capsys, "pretokenize", big, "--output", out, "--shard-tokens", "20000")
        one_line(code, lines, str(out), "No space left on device")
        assert leftovers(out) == []
        subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)
        code, lines = cli(capsys, "pretokenize", big, "--output", out, "--shard-tokens", "20000")
        assert code == 0, lines
        tokenize([big], tmp_path / "ref", shard_tokens=20000)
        assert dir_bytes(out) == dir_bytes(tmp_path / "ref") and verify(out) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)  # lazy: also when a file there is still open


def test_corrupt_parquet_input_names_the_file(tmp_path, capsys):
    bad = tmp_path / "c.parquet"
    bad.write_bytes(b"PAR1 not really parquet")
    one_line(*cli(capsys, "pretokenize", bad, "--output", tmp_path / "out"), "c.parquet", "not a readable parquet")


def test_pack_planning_error_names_flags_and_leaves_no_folder(ref, tmp_path, capsys):
    """The planner's words (`lower dp or micro_batches`) become flags on the CLI, and a run that fails before
    writing anything removes the output folder it created (a folder that was there stays)."""
    out = tmp_path / "packed"
    code, err = cli(capsys, "pack", ref, "--output", out, "--dp", "1000", "--max-tokens", "4096")
    one_line(code, err, "lower --dp or --micro-batches")
    assert not out.exists()
    out.mkdir()
    code, err = cli(capsys, "pack", ref, "--output", out, "--dp", "1000", "--max-tokens", "4096")
    one_line(code, err, "lower --dp or --micro-batches")
    assert out.is_dir() and os.listdir(out) == []


def test_an_input_that_is_neither_file_nor_folder_is_not_a_hub_name(tmp_path, capsys):
    """A pipe or a broken link was taken for a Hugging Face dataset name: 27 s of network retries, then a message
    about the Hub."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    for name in ("pipe", "broken"):
        code, err = cli(capsys, "pretokenize", tmp_path / name, "--output", tmp_path / "out")
        one_line(code, err, str(tmp_path / name), "not a regular file or a folder")
        assert not (tmp_path / "out").exists()
