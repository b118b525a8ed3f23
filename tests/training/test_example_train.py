"""examples/train_cp.py runs standalone (spawning its own dp x cp gloo ranks) and logs predicted vs measured time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # the example's spawned ranks
REPO = Path(__file__).resolve().parents[2]


def test_example_train_two_steps(tmp_path):
    log = tmp_path / "log.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_cp.py"),
            "--dp",
            "2",
            "--cp",
            "2",
            "--steps",
            "2",
            "--docs",
            "120",
            "--max-tokens",
            "256",
            "--log-json",
            str(log),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "done" in r.stdout and "imbalance predicted" in r.stdout
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == 2
    for rec in recs:
        assert len(rec["predicted_s"]) == 2 and len(rec["measured_s"]) == 2
        assert rec["loss"] > 0 and rec["predicted_imbalance"] >= 1.0 and rec["measured_imbalance"] >= 1.0
    assert recs[1]["loss"] < recs[0]["loss"] + 1.0


def test_example_train_on_a_folder_with_its_own_vocabulary_and_split_documents(tmp_path):
    """A pretokenized folder from a trained HF tokenizer (vocabulary 300, not bytes) with documents longer than a
    micro-batch: the example reads the vocabulary from the manifest and splits with --overflow split."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.data_files import make_texts, train_hf_tokenizer, write_jsonl

    from balancer.cli import main

    texts = make_texts(12, seed=5)
    tok = train_hf_tokenizer(tmp_path / "tok", texts, vocab_size=300)
    folder = tmp_path / "data"
    assert main(["pretokenize", str(write_jsonl(tmp_path / "c.jsonl", texts)), "--output", str(folder),
                 "--tokenizer", str(tok)]) == 0  # fmt: skip
    cmd = [sys.executable, str(REPO / "examples" / "train_cp.py"), "--dp", "1", "--cp", "2", "--steps", "1"]
    cmd += ["--data", str(folder), "--max-tokens", "128", "--overflow", "split"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "done" in r.stdout
