"""Read-only and unreadable paths, for real: the tests run as root, who may write anywhere, so these run the CLI as
the unprivileged user `nobody` (through `setpriv` or `runuser`) and skip cleanly where that is impossible. A
read-only output folder, an output inside one and an unreadable input each give one line naming the flag and the
path, exit 2, no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _as_nobody() -> list[str] | None:
    if os.geteuid() != 0:
        return None
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"]
    return None


def _run(prefix: list[str], *argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME="/tmp")
    cmd = [*prefix, sys.executable, "-m", "balancer", *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd="/")


@pytest.fixture(scope="module")
def nobody() -> list[str]:
    prefix = _as_nobody()
    if prefix is None:
        pytest.skip("needs root and setpriv or runuser to run as nobody")
    probe = _run(prefix, "--version")
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot run this checkout's balancer here: {probe.stderr.strip()[-200:]}")
    return prefix


@pytest.fixture()
def place():
    """A folder nobody can reach (pytest's own tmp folders are root's alone): an input, a read-only folder, an
    unreadable input."""
    root = Path(tempfile.mkdtemp(prefix="balancer-nobody-", dir="/tmp"))
    os.chmod(root, 0o755)
    (root / "in.jsonl").write_text('{"text": "hello world"}\n')
    (root / "lengths.json").write_text("[10, 20, 30, 40]")
    for name in ("in.jsonl", "lengths.json"):
        os.chmod(root / name, 0o644)
    (root / "ro").mkdir()
    os.chmod(root / "ro", 0o555)
    for name, text in (("secret.jsonl", '{"text": "x"}\n'), ("secret.json", "[1, 2]")):
        (root / name).write_text(text)
        os.chmod(root / name, 0o000)
    yield root
    shutil.rmtree(root)


def _one_line(done: subprocess.CompletedProcess, flag: str, path: Path) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and f"{flag} {path}" in lines[0], lines[0]
    return lines[0]


def test_a_read_only_output_folder_is_named_with_its_flag(nobody, place):
    ro = place / "ro"
    line = _one_line(_run(nobody, "pretokenize", place / "in.jsonl", "--output", ro), "--output", ro)
    assert "not writable" in line
    assert os.listdir(place / "ro") == []


def test_an_output_inside_a_read_only_folder_is_named_with_its_flag(nobody, place):
    out = place / "ro" / "tok"
    _one_line(_run(nobody, "pretokenize", place / "in.jsonl", "--output", out), "--output", out)
    plan_out = place / "ro" / "p.json"
    _one_line(_run(nobody, "plan", place / "lengths.json", "-o", plan_out), "-o", plan_out)


def test_an_unreadable_input_is_named_with_its_argument(nobody, place):
    line = _one_line(_run(nobody, "pretokenize", place / "secret.jsonl", "--output", place / "out"), "INPUT",
                     place / "secret.jsonl")  # fmt: skip
    assert "Permission denied" in line and not (place / "out").exists()
    for command in ("plan", "stats"):
        _one_line(_run(nobody, command, place / "secret.json"), "LENGTHS", place / "secret.json")
