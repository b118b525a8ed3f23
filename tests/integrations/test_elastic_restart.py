"""torchrun's own elastic restart of the user's own loop (examples/elastic_restart.py), every document of the epoch
exactly once: two torchrun elastic agents on the loopback are two "nodes" (`--nnodes=1:2`, `nproc` workers each,
c10d rendezvous hosted by the agent that survives, `--max-restarts=1`). The other node's workers stop at the end of
step 5 (the checkpoint of step 4 is then the last one: rank 0 writes one every 2 steps) and the test kills that
node, its agent and its workers, with SIGKILL. The surviving agent sees its workers fail (the reduction's peers are
gone), rendezvouses again with itself alone, and starts its workers again on the world of its own node, which load
the step-4 checkpoint and plan the rest of the window for the new DP size. Asserted from the agent's log and the
workers' traces: the first rendezvous made a world of both nodes (restart 0), the second one of the survivor's
(restart 1); every token of every document is trained exactly once over the steps up to the checkpoint (all ranks
of the first world) and every step after the restart."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support.restarts import ROOT, lose_node, read_trace, token_coverage

pytestmark = pytest.mark.slow

HOLD = 5  # the lost node's last step; a checkpoint every 2 steps: step 4's is the last one
DOCS = 400


def _run(tmp_path: Path, nproc: int) -> tuple[str, list[int], list[dict]]:
    """Both agents; the lost node killed once its workers hold; (the host agent's log, the held ranks, the trace)."""
    trace, ckpt = tmp_path / "trace", tmp_path / "ckpt"
    trace.mkdir()
    ckpt.mkdir()
    args = ["--ckpt", str(ckpt), "--trace", str(trace), "--docs", str(DOCS)]
    log, held = lose_node("elastic_restart.py", args, HOLD, tmp_path, trace, nproc)
    return log, held, read_trace(trace)


def test_own_loop_elastic_restart_from_2x2_to_1x2_every_document_once(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from elastic_restart import lengths_of

    nproc = 2  # workers per node: a world of 4, then of 2 (the 1-worker case is a subset: ~33 s more for nothing)
    log, held, lines = _run(tmp_path, nproc)
    # the agent's own account: the first rendezvous took both nodes, the restart (1 of 1 allowed) the survivor alone
    nodes = re.findall(r"group_world_size=(\d+)", log)
    assert nodes[:1] == ["2"], f"the first rendezvous did not take both nodes (one later than the last call): {nodes}"
    assert nodes == ["2", "1"] and re.findall(r"restart_count=(\d+)", log) == ["0", "1"], log[-4000:]
    before = [r for r in lines if r["restart"] == 0]
    after = [r for r in lines if r["restart"] == 1]
    assert before and after and len(before) + len(after) == len(lines)
    assert {r["world"] for r in before} == {2 * nproc} and {r["world"] for r in after} == {nproc}
    assert {r["rank"] for r in after} == set(range(nproc))
    for rank in held:  # step 5 ran on the lost node, then was lost with it
        assert max(r["step"] for r in before if r["rank"] == rank) == HOLD
    for rank in range(2 * nproc):  # every rank of the first world traced every step up to the checkpoint, once
        assert sorted(r["step"] for r in before if r["rank"] == rank and r["step"] <= 4) == [1, 2, 3, 4]
    for rank in range(nproc):  # from step 5 (trained again) to the end of the epoch, on every rank of the second
        steps = [r["step"] for r in after if r["rank"] == rank]
        assert steps == list(range(HOLD, HOLD + len(steps))) and len(steps) > 1
    trained = [r for r in before if r["step"] <= 4] + after
    seen = token_coverage((p for r in trained for mb in r["mbs"] for p in mb), lengths_of(DOCS))
    assert seen.min() == 1 and seen.max() == 1  # every token of every document, each once
