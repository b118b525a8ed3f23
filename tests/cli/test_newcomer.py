"""Rough edges a new user met, each pinned: no warning from our own collator, built-in traces that are built in,
readable rates, pack's balance figures, progress without a terminal, one-line errors from the examples."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import balancer
from balancer.cli import build_parser, main
from balancer.data.pretokenize import summary as progress
from balancer.data.pretokenize.options import PretokenizeOptions
from balancer.data.pretokenize.pipeline import pretokenize
from balancer.data.traces import NAMES, RECORDED, load_trace

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A small pretokenized folder (byte tokenizer): 120 documents of 40..900 tokens, one of 3,000."""
    d = tmp_path_factory.mktemp("newcomer")
    rng = np.random.default_rng(3)
    lengths = [*rng.integers(40, 900, 120).tolist(), 3000]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": "ab" * (n // 2) + "a" * (n % 2)}) + "\n" for n in lengths))
    pretokenize([str(d / "c.jsonl")], d / "tok", options=PretokenizeOptions(), progress=False)
    return d / "tok"


def test_collating_a_datasets_batch_emits_no_warning():
    """`datasets` hands a batch's rows as read-only numpy views (`Dataset.__getitems__`, what DataLoader calls):
    the collator copies them rather than letting torch warn on every SFT step."""
    import datasets

    from balancer.trainers.trainer import _dataset_for_packing

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, int(n)).tolist() for n in rng.integers(5, 50, 12)]
    dataset = _dataset_for_packing(datasets.Dataset.from_dict({"input_ids": rows, "labels": rows, "text": ["x"] * 12}))
    items = dataset.__getitems__([3, 4, 5])  # a contiguous range: zero-copy views
    assert not all(item[key].flags.writeable for item in items for key in ("input_ids", "labels"))  # it warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = balancer.PackedCollator()(items)
    assert batch["input_ids"][0].tolist() == rows[3] + rows[4] + rows[5]
    assert batch["labels"].numel() == batch["input_ids"].numel()


def test_calibrate_takes_dash_q_like_the_other_commands():
    for command in (["calibrate"], ["plan", "wlbllm"], ["pretokenize", "x.jsonl", "-o", "out"]):
        assert build_parser().parse_args([*command, "-q"]).quiet


def test_every_trace_name_is_built_in(tmp_path, monkeypatch):
    """`plan --help` lists the trace names; each loads from the package alone (no shared/ folder, no variable)."""
    monkeypatch.delenv("BALANCER_TRACES", raising=False)
    for path in RECORDED.values():
        assert path.parent == Path(balancer.__file__).parent / "data" and path.exists()
    for name in NAMES:
        assert len(load_trace(name, n=1000)) == 1000
    assert len(load_trace("prolong")) == 77_932
    help_text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert all(name in help_text for name in NAMES)
    monkeypatch.chdir(tmp_path)
    assert main(["stats", "prolong", "--no-plan"]) == 0


@pytest.mark.parametrize(
    "size,text",
    [(0, "0 B"), (512, "512 B"), (1667, "1.67 kB"), (41_200, "41.2 kB"), (3.07e6, "3.07 MB"), (2e9, "2 GB")],
)
def test_byte_size_keeps_three_digits(size, text):
    assert progress.byte_size(size) == text


def test_summary_of_a_slow_small_run_shows_a_rate(tok, capsys):
    """0.4 MB in 240 s was printed as "0.0 MB/s"."""
    manifest = json.loads((tok / "manifest.json").read_text())
    manifest["inputs"] = [{**manifest["inputs"][0], "size": 400_000}]
    progress.summarize(tok, manifest, seconds=240.0)
    err = capsys.readouterr().err
    assert "400 kB read in 240.0 s (1.67 kB/s, 246 tokens/s)" in err and "0.0 MB/s" not in err


def test_pack_prints_the_balance_it_records(tok, tmp_path, capsys):
    code = main(["pack", str(tok), "-o", str(tmp_path / "packed"), "--dp", "2", "--max-tokens", "4096"])
    out = capsys.readouterr().out
    assert code == 0
    metrics = json.loads((tmp_path / "packed" / "manifest.json").read_text())["epochs"][0]["metrics"]
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    for name in ("imbalance", "worst_step", "epoch_efficiency", "token_utilization"):
        assert float(lines[name][0]) == pytest.approx(metrics[name], abs=1e-4), name
    assert int(lines["steps"][0]) == metrics["steps"]


def test_progress_lines_without_a_terminal_also_while_nothing_arrives(monkeypatch, capsys):
    monkeypatch.setattr(progress, "PROGRESS_LINE_S", 0.05)
    err: list[str] = []

    def wait_for(prefix: str) -> None:  # the timer thread reports on its own; a busy machine may delay it
        deadline = time.monotonic() + 30
        while not any(line.startswith(prefix) for line in err) and time.monotonic() < deadline:
            time.sleep(0.05)
            err.extend(capsys.readouterr().err.splitlines())

    lines = progress.ProgressLines(total=2_000_000, initial=0, enabled=True)
    wait_for("pretokenize: 0 B of 2 MB read (0%), 0 documents")  # no batch arrives: the timer still reports
    lines.done, lines.documents = 1_000_000, 42
    wait_for("pretokenize: 1 MB of 2 MB read (50%), 42 documents")
    lines.close()  # waits for a line the timer may be printing: after it, the timer prints nothing more
    assert not lines.thread.is_alive()
    err.extend(capsys.readouterr().err.splitlines())
    assert any(line.startswith("pretokenize: 0 B of 2 MB read (0%), 0 documents") for line in err)
    assert any(line.startswith("pretokenize: 1 MB of 2 MB read (50%), 42 documents") for line in err)
    silent = progress.ProgressLines(total=10, initial=0, enabled=False)
    silent.close()
    assert not silent.thread.is_alive() and capsys.readouterr().err == ""


def test_train_cp_example_names_its_overflow_flag_in_one_line(tok):
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_cp.py"), "--data", str(tok), "--dp", "1", "--cp", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--overflow split" in done.stderr and "3,000 tokens" in done.stderr and "--max-tokens" in done.stderr
