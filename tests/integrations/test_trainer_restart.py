"""BalancedTrainer killed on 3 processes and restarted on 2 from its last checkpoint, every document of the epoch
exactly once (examples/trainer_restart.py under torchrun, a tiny Llama from its config, gloo): the first launch
saves a checkpoint every 2 optimizer steps and its last rank dies (SIGKILL) at the end of step 5, which stops the
job; the relaunch on 2 processes resumes from checkpoint-4 with `resume_from_checkpoint`, its sampler planning the
rest of the epoch for dp=2. The tokens of the first launch's steps up to the checkpoint and of every step of the
relaunch add up to every document's length, each once (document d's tokens are all d + 1). A checkpoint folder
left half-written (no trainer_state.json, as by a process killed while saving) is skipped by the relaunch."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from support.restarts import ROOT, kill_then_relaunch

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
pytest.importorskip("datasets")


def test_balanced_trainer_killed_on_3_restarts_on_2_every_document_once(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from trainer_restart import lengths_of

    (tmp_path / "trace").mkdir()
    common = ["--out", str(tmp_path / "run"), "--trace", str(tmp_path / "trace")]

    def checkpoint_4_is_the_last(tail: str) -> None:
        assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))[-1] == "checkpoint-4", tail
        half = tmp_path / "run" / "checkpoint-6"  # as a process killed while saving leaves it: no trainer_state.json
        half.mkdir()
        (half / "balancer_sampler.json").write_text("{")

    first, second = kill_then_relaunch("trainer_restart.py", tmp_path / "trace", (3, [*common, "--die-at", "5"]),
                                       (2, [*common, "--resume"]), between=checkpoint_4_is_the_last)  # fmt: skip
    assert max(r["step"] for r in first if r["rank"] == 2) == 5  # step 5 ran on every rank, then was lost
    assert min(r["step"] for r in second) == 5  # and was trained again after the restart
    seen: Counter = Counter()
    for r in [r for r in first if r["step"] <= 4] + second:
        seen.update({int(d): n for d, n in r["tokens"].items()})
    lengths = lengths_of(240)
    assert -1 not in seen  # no padding token (0) among the trained tokens
    assert dict(seen) == {d: int(n) for d, n in enumerate(lengths)}  # every document's tokens, each once
