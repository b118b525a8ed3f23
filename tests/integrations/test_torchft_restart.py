"""Without torchft: a run killed on N processes restarts on M from its last checkpoint, every document of the epoch
exactly once. examples/elastic_restart.py runs under torchrun on three processes (gloo); after step 5 the last
worker dies (SIGKILL) and the job stops; the job is launched again on two processes, which load the last checkpoint
(step 4) and plan the rest of the window for dp=2. The restart is a new launch, as a scheduler does it: torchrun's
elastic agents restarting in place (`--nnodes 1:3`) raced in their rendezvous on this 2-core machine (2 of 5 runs
finished) and are documented as a recipe only. BalancedTrainer's resume onto another topology:
tests/training/test_trainer_resume.py."""

from __future__ import annotations

import sys

import pytest
from support.restarts import ROOT, kill_then_relaunch, token_coverage

pytestmark = pytest.mark.slow


def test_restart_from_3_to_2_processes_every_document_once(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from elastic_restart import lengths_of

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "log").mkdir()
    common = ["--ckpt", str(tmp_path / "ckpt"), "--trace", str(tmp_path / "log")]
    first, second = kill_then_relaunch("elastic_restart.py", tmp_path / "log",
                                       (3, [*common, "--die-at", "5", "--die-alone"]), (2, common))  # fmt: skip
    resumed_at = min(r["step"] for r in second) - 1  # the checkpoint's step
    assert resumed_at == 4 and max(r["step"] for r in first if r["rank"] == 2) == 5  # step 5 ran, was lost, re-done
    trained = [r for r in first if r["step"] <= resumed_at] + second
    seen = token_coverage((p for r in trained for mb in r["mbs"] for p in mb), lengths_of(400))
    assert seen.min() == 1 and seen.max() == 1
