"""Every Python snippet of docs/training.md runs as written (one interpreter, a fresh namespace per snippet, in a
scratch folder holding the local tokenizer `tokenizer/` the SFT snippet reads)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.data_files import make_texts, train_hf_tokenizer  # noqa: E402

pytest.importorskip("trl")
pytest.importorskip("torchdata")

pytestmark = pytest.mark.slow  # the training docs' Trainer snippets
REPO = Path(__file__).resolve().parents[2]

RUNNER = """
import pathlib, sys, torch
torch.manual_seed(0)
for i, code in enumerate(pathlib.Path(sys.argv[1]).read_text().split("\\0# ---- next snippet\\n")):
    print(f"==== snippet {i}", flush=True)
    exec(compile(code, f"docs/training.md snippet {i}", "exec"), {"__name__": "__main__"})
"""


def test_training_doc_snippets_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "training.md").read_text(), flags=re.S)
    assert len(blocks) >= 4  # the Trainer, the SFT trainer, your own loop, StatefulDataLoader
    train_hf_tokenizer(tmp_path / "tokenizer", make_texts(20, seed=1), vocab_size=300)
    (tmp_path / "snippets.py").write_text("\0# ---- next snippet\n".join(blocks))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path / "snippets.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("==== snippet") == len(blocks) and "True" in run.stdout
