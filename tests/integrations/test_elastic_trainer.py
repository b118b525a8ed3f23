"""torchrun's own elastic restart of BalancedTrainer, every document of the epoch exactly once: two torchrun
elastic agents on the loopback are two "nodes" (`--nnodes=1:2`, one worker each, c10d rendezvous hosted by the
agent that survives, `--max-restarts=1`) training examples/trainer_restart.py with `--resume-if-any` (a checkpoint
every 2 steps). The other node's worker stops at the end of step 5 (checkpoint-4 is then the last complete one) and
the test kills that node, its agent and its worker, with SIGKILL. The surviving agent sees its worker fail (the
reduction's peer is gone), rendezvouses again with itself alone (min nodes 1: the dead node's heartbeat expires,
then the last call), and starts its worker again on a world of 1, which resumes from checkpoint-4 and plans the rest
of the epoch for dp=1. Asserted from the agent's log and the workers' traces: the first rendezvous made a world of 2
(restart 0), the second a world of 1 (restart 1); the tokens of the steps up to the checkpoint (both ranks) and of
every step after the restart are every document's tokens, each once (document d's tokens are all d + 1)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support.restarts import ROOT, lose_node, read_trace, traced_tokens

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
pytest.importorskip("datasets")

HOLD = 5  # the lost node's last step; checkpoints every 2 steps: checkpoint-4 is the last complete one


def test_torchrun_elastic_restart_from_2_nodes_to_1_every_document_once(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from trainer_restart import lengths_of

    trace, run = tmp_path / "trace", tmp_path / "run"
    trace.mkdir()
    args = ["--out", str(run), "--trace", str(trace), "--resume-if-any"]
    log, held = lose_node("trainer_restart.py", args, HOLD, tmp_path, trace)
    # the agent's own account: the first rendezvous made a world of 2, the restart (1 of 1 allowed) a world of 1
    worlds = re.findall(r"group_world_size=(\d+)", log)
    assert worlds[:1] == ["2"], f"the first rendezvous did not take both nodes (one later than the last call): {worlds}"
    assert worlds == ["2", "1"] and re.findall(r"restart_count=(\d+)", log) == ["0", "1"], log[-4000:]
    _check_trace(read_trace(trace), held[0], run, lengths_of(240))


def _check_trace(lines: list[dict], held: int, run: Path, lengths) -> None:
    """Two runs in the trace, told by the elastic restart count: dp=2 from scratch, then dp=1 from checkpoint-4;
    the steps up to the checkpoint and those after the restart hold every document's tokens, each once."""
    before = [r for r in lines if r["restart"] == 0]
    after = [r for r in lines if r["restart"] == 1]
    assert before and after and len(before) + len(after) == len(lines)
    assert {(r["world"], r["resumed"]) for r in before} == {(2, None)}
    assert {(r["world"], r["rank"], r["resumed"]) for r in after} == {(1, 0, str(run / "checkpoint-4"))}
    assert max(r["step"] for r in before if r["rank"] == held) == HOLD  # step 5 ran, then was lost with the node
    for rank in (0, 1):  # both ranks traced every step up to the checkpoint, once
        assert sorted(r["step"] for r in before if r["rank"] == rank and r["step"] <= 4) == [1, 2, 3, 4]
    steps = [r["step"] for r in after]
    assert steps == list(range(HOLD, HOLD + len(steps)))  # from step 5 (trained again) to the end of the epoch
    seen = traced_tokens([r for r in before if r["step"] <= 4] + after)
    assert -1 not in seen  # no padding token (0) among the trained tokens
    assert dict(seen) == {d: int(n) for d, n in enumerate(lengths)}  # every document's tokens, each once
