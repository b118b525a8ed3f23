"""The plain-loop snippet of docs/post-training.md runs as written (the other blocks there are fragments:
signatures and calls inside a trainer)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # the docs' training loop: ~10 s
REPO = Path(__file__).resolve().parents[2]


def test_plain_loop_snippet_runs(tmp_path):
    page = (REPO / "docs" / "post-training.md").read_text()
    section = page.split("## A plain loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    code += "\nassert plan.num_steps == 2 and len(plan.rank_view(0)) == 2\nprint('snippet done')\n"
    (tmp_path / "snippet.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(tmp_path / "snippet.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "snippet done" in run.stdout
