"""The planning commands (plan, stats, demo, calibrate) never overwrite what they read, refuse conflicting and
out-of-range flags naming them, and every refusal is one line, exit code 2, before any work and with nothing
written."""

from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from support.reliability import cli  # noqa: E402

from balancer import CostModel, Plan  # noqa: E402
from balancer.data.shards.errors import describe_os_error  # noqa: E402


def one_line(code: int, lines: list[str], *needles: str) -> str:
    assert code == 2, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for needle in needles:
        assert needle in lines[0], (needle, lines)
    return lines[0]


@pytest.fixture
def lengths(tmp_path) -> Path:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(np.random.default_rng(0).integers(1, 900, 200).tolist()))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    from balancer.cli import main

    base = tmp_path_factory.mktemp("tok")
    src = base / "c.jsonl"
    src.write_text("".join(json.dumps({"text": "word " * (5 + i)}) + "\n" for i in range(40)))
    assert main(["pretokenize", str(src), "--output", str(base / "tok")]) == 0
    return base / "tok"


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# ---------------------------------------------------------------------------------------------------- outputs
def test_a_document_no_micro_batch_can_hold_is_named(tmp_path, capsys):
    path = tmp_path / "big.json"
    path.write_text(json.dumps([5, 2**62, 7]))
    one_line(*cli(capsys, "plan", path, "--dp", "1", "-o", tmp_path / "p.json"), "document 1 has", "2^40")


def test_plan_refuses_to_overwrite_its_lengths(lengths, tmp_path, capsys):
    before = lengths.read_bytes()
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", lengths), "-o", "is the input", str(lengths))
    (tmp_path / "link.json").symlink_to(lengths)
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", tmp_path / "link.json"), "is the input")
    assert lengths.read_bytes() == before and (tmp_path / "link.json").is_symlink()


def test_a_pipe_or_device_output_is_refused_not_replaced(lengths, tmp_path, capsys):
    """The file is written beside the output and renamed over it: `-o /dev/null` run as root replaced the device."""
    import stat

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", fifo), "-o", "not a regular file")
    one_line(*cli(capsys, "stats", lengths, "--plot", fifo), "--plot", "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_output_names_long_or_empty(lengths, tmp_path, capsys):
    """A 255-byte name is written (its temporary name was longer, so it failed after planning); a longer one, or an
    empty -o (it fell back to the default path), is refused before any work."""
    longest = tmp_path / ("a" * 250 + ".json")
    assert cli(capsys, "plan", lengths, "--dp", "2", "-o", longest)[0] == 0 and longest.is_file()
    too_long = tmp_path / ("a" * 300 + ".json")
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", too_long), "-o", "over the file system's limit")
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", ""), "-o: an empty path")
    assert capsys.readouterr().out == "" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [longest.name, lengths.name]
    )


def test_plan_refuses_its_inputs_by_any_path(lengths, tok, tmp_path, monkeypatch, capsys):
    """A hard link, a path through `..`, a symlinked folder: the same file or folder, refused."""
    before, tok_before = lengths.read_bytes(), _snapshot(tok)
    os.link(lengths, tmp_path / "hard.json")
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", tmp_path / "hard.json"), "is the input")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    relative = Path("..") / "sub" / ".." / lengths.name
    one_line(*cli(capsys, "plan", relative, "--dp", "2", "-o", Path("..") / lengths.name), "is the input")
    (tmp_path / "toklink").symlink_to(tok)
    one_line(*cli(capsys, "plan", tmp_path / "toklink", "--dp", "1", "-o", tok / "manifest.json"), "inside the input")
    one_line(*cli(capsys, "plan", tok, "--dp", "1", "-o", tmp_path / "toklink" / "manifest.json"), "inside the input")
    assert lengths.read_bytes() == before and _snapshot(tok) == tok_before


def test_plan_refuses_a_file_inside_the_folder_it_reads(tok, capsys):
    before = _snapshot(tok)
    one_line(*cli(capsys, "plan", tok, "--dp", "1", "-o", tok / "manifest.json"), "inside the input folder")
    one_line(*cli(capsys, "plan", tok, "--dp", "1", "-o", tok / "new.json"), "inside the input folder")
    assert _snapshot(tok) == before


def test_no_output_lands_in_a_balancer_data_folder(tok, lengths, capsys):
    before = _snapshot(tok)
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", tok / "p.json"), "balancer data folder", "manifest")
    one_line(*cli(capsys, "stats", lengths, "--no-plan", "--plot", tok / "x.png"), "--plot", "balancer data folder")
    assert _snapshot(tok) == before


def test_cost_and_config_inputs_are_protected(lengths, tmp_path, capsys):
    cost = tmp_path / "cost.json"
    CostModel(attn_coef=1e-5, linear_coef=1.0).save(cost)
    before = cost.read_bytes()
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "--cost", cost, "-o", cost), "-o", "is the input")
    one_line(*cli(capsys, "stats", lengths, "--cost", cost, "--plot", cost), "--plot", "is the input")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4}))  # fmt: skip
    one_line(*cli(capsys, "calibrate", "--model-config", config, "-o", config), "-o", "is the input")
    assert cost.read_bytes() == before and json.loads(config.read_text())["hidden_size"] == 64


def test_plot_is_checked_before_planning(lengths, tmp_path, capsys):
    out = tmp_path / "p.json"
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", out, "--plot", tmp_path / "x.txt"), "--plot", ".txt")
    assert not out.exists() and capsys.readouterr().out == ""
    one_line(*cli(capsys, "demo", "--plot", tmp_path / "x.txt"), "--plot")
    assert capsys.readouterr().out == ""  # no statistics, no planning
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", out, "--plot", out), "-o and --plot name the same")
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", tmp_path), "is a folder")
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "-o", lengths / "sub" / "p.json"), "is a file, not a folder")
    assert capsys.readouterr().out == ""  # refused before planning
    assert sorted(os.listdir(tmp_path)) == ["lengths.json"]


def test_an_output_that_is_a_link_is_refused_naming_it(lengths, tmp_path, capsys):
    """A link as an output, to a file, to a device or to a folder: refused naming it, the link and its target left
    as they were (before, the link was replaced by the plan: a write must neither go through a link nor replace
    one). The API's writers refuse it too."""
    target = tmp_path / "someone-elses.json"
    target.write_text("keep me")
    links = {"file": (tmp_path / "p.json", target), "device": (tmp_path / "null.json", Path("/dev/null"))}
    for link, to in links.values():
        link.symlink_to(to)
        for command in (["plan", lengths, "--dp", "2", "--no-baseline"], ["calibrate"]):
            one_line(*cli(capsys, *command, "-o", link), f"-o {link} is a symbolic link (to {to})")
        assert link.is_symlink() and os.readlink(link) == str(to)
    assert target.read_text() == "keep me" and os.path.exists("/dev/null")
    from balancer import Topology, balance_batch

    plan = balance_batch(np.array([5, 6, 7]), Topology(dp=1, max_tokens=64), CostModel(1.0, 1.0))
    for save in (plan.save, CostModel(1.0, 1.0).save):
        with pytest.raises(ValueError, match="is a symbolic link"):
            save(links["file"][0])
    assert target.read_text() == "keep me"
    folder = tmp_path / "real"
    folder.mkdir()
    (tmp_path / "out").symlink_to(folder)
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a b c"}\n')
    one_line(
        *cli(capsys, "pretokenize", src, "--output", tmp_path / "out"), f"--output {tmp_path / 'out'} is a symbolic"
    )
    assert os.listdir(folder) == [] and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_plan_says_which_cost_model_it_used(lengths, tmp_path, capsys):
    code, lines = cli(capsys, "plan", lengths, "--dp", "2", "-o", tmp_path / "p.json", "--model", "llama3-8b")
    assert code == 0 and sum(line.startswith("cost model: --model llama3-8b") for line in lines) == 1, lines
    code, lines = cli(capsys, "plan", lengths, "--dp", "2", "-o", tmp_path / "p.json", "--window", "128")
    assert any(line.startswith("cost model: the default") and "window 128" in line for line in lines), lines


# ---------------------------------------------------------------------------------------------------- conflicts
@pytest.mark.parametrize(
    "flags, first, second",
    [
        (["--cost", "COST", "--attn-coef", "1"], "--cost", "--attn-coef"),
        (["--cost", "COST", "--window", "64"], "--cost", "--window"),
        (["--cost", "COST", "--model", "llama3-8b"], "--cost", "--model"),
        (["--cost", "COST", "--non-causal"], "--cost", "--non-causal"),
        (["--model", "llama3-8b", "--attn-coef", "1"], "--model", "--attn-coef"),
        (["--model", "llama3-8b", "--model-config", "CONFIG"], "--model", "--model-config"),
        (["--model-config", "CONFIG", "--linear-coef", "2"], "--model-config", "--linear-coef"),
        (["--tokens-per-step", "5000", "--fill", "0.5"], "--tokens-per-step", "--fill"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "stats", "demo"])
def test_conflicting_flags_are_refused_naming_both(lengths, tmp_path, capsys, command, flags, first, second):
    cost = tmp_path / "cost.json"
    CostModel(attn_coef=1e-5, linear_coef=1.0).save(cost)
    flags = [str(cost) if f == "COST" else str(tmp_path / "config.json") if f == "CONFIG" else f for f in flags]
    source = [] if command == "demo" else [lengths]
    message = one_line(*cli(capsys, command, *source, *flags), first, second, "cannot be used together")
    assert message.startswith(f"balancer {command}: error: ")


def test_stats_without_a_plan_refuses_topology_flags(lengths, capsys):
    one_line(*cli(capsys, "stats", lengths, "--no-plan", "--dp", "4"), "--no-plan", "--dp")


def test_model_flags_keep_fixed_window_and_mask(lengths, tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["--model", "llama3-8b", "--fixed", "5", "--window", "64", "--non-causal", "-o", out, "--no-baseline"]
    assert cli(capsys, "plan", lengths, "--dp", "2", *argv)[0] == 0
    cost = Plan.load(out).cost_model
    assert (cost.fixed, cost.window, cost.causal) == (5.0, 64, False)


# ---------------------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--max-tokens", "99999999999999999999"], "--max-tokens must be in [1, 2^40], got 99999999999999999999"),
        (["--dp", "99999999999999999999"], "--dp must be in [1, 2^20], got 99999999999999999999"),
        (["--micro-batches", "0"], "--micro-batches must be in [1, 2^20], got 0"),
        (["--tokens-per-step", "99999999999999999999"], "--tokens-per-step must be in [1, 2^62]"),
        (["--seed", "-1"], "--seed must be in [0, 2^63-1], got -1"),
        (["--window", "0"], "--window must be in [1, 2^40], got 0"),
        (["--fixed", "nan"], "argument --fixed: must be a finite number >= 0"),
        (["--fixed", "1e308"], "argument --fixed: must be a finite number >= 0 and <= 1e+100"),
        (["--attn-coef", "1e200"], "argument --attn-coef: must be a finite number >= 0 and <= 1e+100"),
        (["--attn-coef", "-1"], "argument --attn-coef"),
        (["--cp-sizes", "1,99999999999999999999"], "--cp-sizes: size 99999999999999999999 is above"),
        (["--fill", "0.00001"], "--fill 1e-05 of a capacity"),
        (["--tokens-per-step", "3"], "--tokens-per-step gives 3 tokens per step, less than half an average document"),
        (["--max-tokens", "1099511627776", "--dp", "1048576"], "exceeds 2^53 tokens per step: lower --max-tokens"),
    ],
)
def test_numeric_flags_are_bounded_before_work(lengths, tmp_path, capsys, argv, needle):
    out = tmp_path / "p.json"
    message = one_line(*cli(capsys, "plan", lengths, *argv, "-o", out), needle)
    assert "--tokens-per-step" not in message or "--fill" not in argv
    assert not out.exists() and capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--threads", "0"], "argument --threads: must be in [1, 1,024], got 0"),
        (["--tokens", "256", "99999999999999999999"], "argument --tokens: must be in [16, 131,072]"),
        (["--cp", "1", "4096"], "argument --cp"),
        (["--repeats", "99999999999999999999"], "argument --repeats"),
        (["--seed", "-1"], "argument --seed"),
        (["--per-cell", "1000", "--repeats", "1000", "--cp", "1", "2", "4"], "timed runs, over the limit of 100,000"),
    ],
)
def test_calibrate_counts_are_bounded(tmp_path, capsys, argv, needle):
    one_line(*cli(capsys, "calibrate", "-o", tmp_path / "c.json", *argv), needle)
    assert not (tmp_path / "c.json").exists()


def test_a_tiny_step_budget_on_a_large_trace_is_refused_not_planned(tmp_path, capsys):
    """`--tokens-per-step 1` used to plan ~100K one-document steps for minutes."""
    one_line(*cli(capsys, "plan", "wlbllm", "--dp", "1", "--micro-batches", "1", "--tokens-per-step", "1",
                  "-o", tmp_path / "p.json"), "--tokens-per-step gives 1 tokens per step")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- input files
@pytest.mark.parametrize(
    "config, needle",
    [
        ({"num_attention_heads": 0}, '"num_attention_heads": expected an integer in [1, 2147483647], got 0'),
        ({"hidden_size": "64"}, '"hidden_size": expected an integer in [1, 2147483647], got "64"'),
        ({"num_hidden_layers": None}, 'missing key "num_hidden_layers"'),
    ],
)
def test_model_config_errors_name_file_and_key(lengths, tmp_path, capsys, config, needle):
    path = tmp_path / "config.json"
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    path.write_text(json.dumps({k: v for k, v in {**base, **config}.items() if v is not None}))
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "--model-config", path), str(path), needle)
    one_line(*cli(capsys, "calibrate", "--model-config", path, "-o", tmp_path / "c.json"), str(path), needle)
    path.write_bytes(b'{"hidden_size": "\xff"}')
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "--model-config", path), str(path), "not UTF-8")


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b'{"attn_coef": 1e-5, "linear_coef": 1, "causal": "false"}', '"causal": expected true or false'),
        (b'{"attn_coef": 1e-5, "linear_coef": 1, "window": true}', '"window": expected an integer >= 1'),
        (b"\xff\xfe", "not UTF-8"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_cost_file_errors_name_file_and_key(lengths, tmp_path, capsys, payload, needle):
    path = tmp_path / "cost.json"
    path.write_bytes(payload)
    one_line(*cli(capsys, "plan", lengths, "--dp", "2", "--cost", path), str(path), needle)


def test_missing_input_files_name_the_flag(lengths, tmp_path, capsys):
    one_line(*cli(capsys, "plan", lengths, "--cost", tmp_path / "no.json"), "--cost", "no.json", "No such file")
    one_line(*cli(capsys, "calibrate", "--model-config", tmp_path / "no.json"), "--model-config", "No such file")


def test_os_errors_without_a_file_name_do_not_say_no_file():
    assert describe_os_error(OSError(errno.ENOSPC, "No space left on device")).startswith("No space left on device")
    assert "(no file)" not in describe_os_error(OSError("p.json: cannot write"))


def test_count_limits_have_one_owner():
    """The CLI's flags and the data commands read their ranges from balancer.limits, and word them alike."""
    import inspect
    import re

    import balancer.cli.flags as flags
    import balancer.data.shards.limits as data_limits
    from balancer.data.shards.errors import DataError, render_message
    from balancer.limits import MAX_RANKS

    for module in (flags, data_limits):
        assert not re.search(r"^(MAX|DEFAULT)_\w+ =", inspect.getsource(module), re.M), module.__name__
    assert "balancer.cli" not in inspect.getsource(data_limits)
    with pytest.raises(ValueError) as cli_error:
        flags.check_counts(argparse.Namespace(dp=0))
    with pytest.raises(DataError) as api_error:
        data_limits.check_count("dp", 0, 1, MAX_RANKS)
    assert str(cli_error.value) == render_message(str(api_error.value.raw_message), {"dp": "--dp"})
