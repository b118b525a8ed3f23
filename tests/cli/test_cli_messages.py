"""Every subcommand, given a missing, dangling, non-UTF-8-named or wrong-kind path, an empty path, or an unknown
or misplaced flag: one line naming the flag or argument and the path, exit 2, no traceback."""

from __future__ import annotations

import os

import pytest
from support.reliability import cli  # noqa: E402


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file.json").write_text("[5, 6, 7]")
    return {
        "missing": tmp_path / "nope",
        "dangling": tmp_path / "dangling",
        "non-UTF-8 name": os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xff"),
        "a file": tmp_path / "file.json",
    }


def _one_line(code, lines, *needles):
    assert code == 2, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for needle in needles:  # a non-UTF-8 name is printed with its byte escaped (\udcff), never a crash
        shown = str(needle).encode("utf-8", "backslashreplace").decode()
        assert shown in lines[0], (shown, lines)


@pytest.mark.parametrize("kind", ["missing", "dangling", "non-UTF-8 name", "a file"])
def test_verify_refuses_what_is_not_a_folder_as_bad_input(paths, capsys, kind):
    """Before: exit 1 ("1 problem(s)"), the code of a folder that fails verification."""
    _one_line(*cli(capsys, "verify", paths[kind]), "error: DIR", paths[kind])


@pytest.mark.parametrize("kind", ["missing", "dangling", "non-UTF-8 name"])
@pytest.mark.parametrize(
    "command",
    [
        ["plan", "{p}", "--dp", "2"],
        ["stats", "{p}"],
        ["pack", "{p}", "--output", "{tmp}/o", "--dp", "2"],
        ["merge", "{p}", "--output", "{tmp}/o"],
        ["pretokenize", "{p}", "--output", "{tmp}/o"],
        ["plan", "{file}", "--dp", "1", "--cost", "{p}"],
        ["calibrate", "--model-config", "{p}", "-o", "{tmp}/c.json"],
    ],
)
def test_bad_input_paths_are_one_line_naming_the_path(paths, tmp_path, capsys, kind, command):
    argv = [a.format(p=paths[kind], tmp=tmp_path, file=paths["a file"]) for a in command]
    _one_line(*cli(capsys, *argv), paths[kind])
    assert not (tmp_path / "o").exists() and not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["pretokenize", "{file}", "--output", ""], "argument --output/-o: an empty path"),
        (["merge", "{tmp}", "--output", ""], "argument --output/-o: an empty path"),
        (["pack", "{tmp}", "--output", "", "--dp", "2"], "argument --output/-o: an empty path"),
        (["pack", "", "--output", "{tmp}/o", "--dp", "2"], "argument TOKDIR: an empty path"),
        (["verify", ""], "argument DIR: an empty path"),
        (["pretokenize", "", "--output", "{tmp}/o"], "argument INPUT: an empty path"),
        (["plan", "{file}", "--dp", "2", "-o", ""], "-o: an empty path"),
        (["plan", "{file}", "--dp", ""], "argument --dp"),
        (["plan", "{file}", "--dpp", "2"], "unrecognized arguments: --dpp"),
        (["--dp", "2", "plan", "{file}"], "invalid choice"),
        (["verify", "{tmp}", "extra"], "unrecognized arguments: extra"),
        (["calibrate", "--tokens", "x"], "argument --tokens"),
    ],
)
def test_empty_values_and_unknown_or_misplaced_flags_name_the_flag(paths, tmp_path, capsys, argv, needle):
    """Before, an empty --output meant the current folder (refused only because it was not empty)."""
    argv = [a.format(tmp=tmp_path, file=paths["a file"]) for a in argv]
    _one_line(*cli(capsys, *argv), needle)
    assert sorted(os.listdir(tmp_path)) == ["dangling", "file.json"]
