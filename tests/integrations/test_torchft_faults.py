"""The real engine: torchft's lighthouse and every replica group as processes on gloo (benchmarks/faults_run.py),
replicas killed with SIGKILL at random steps (mid-forward, mid-reduction, between steps) and started again; over
the whole run every document is in exactly one committed step, every group logged the same plan for a committed
step, the data state after every committed step (a rejoined group's included) is the same on every group, and the
trained weights equal a single-process, unpacked replay of the committed steps (the loss normalisation by the
contributors' global loss tokens is the plain one). Both quorum modes. CP inside a replica group: both ranks of a
group get the same micro-batches and the collator's loss tokens over the groups add up to the step's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from support.torchft_fixtures import faults_run as load_faults_run

pytest.importorskip("torchft", reason="torchft is installed by the test extras (tools/setup.sh test)")
faults_run = load_faults_run()

pytestmark = pytest.mark.slow


def check_run(cfg: faults_run.Config, result: dict) -> dict:
    steps = faults_run.committed_steps(result["lines"])  # raises when two groups logged different plans
    cov = faults_run.coverage(steps, cfg.lengths())
    assert cov == {"lost": 0, "duplicated": 0, "steps": len(steps), "gaps": []}, cov
    for count, digests in faults_run.states_agree(result["lines"]).items():
        assert len(digests) == 1, f"the groups' data states differ after committed step {count}: {digests}"
    finals = {f["state"] for f in result["finals"] if f["rank"] == 0}
    assert len(finals) == 1 and result["finished"]
    return steps


@pytest.mark.parametrize("async_quorum", [True, False], ids=["async", "sync"])
def test_kill_9_and_rejoin_every_document_once(tmp_path, async_quorum):
    import torch

    rng = random.Random(43 + async_quorum)
    kills = [[1, rng.randint(2, 5), "forward"], [2, rng.randint(8, 11), "reduce"], [0, rng.randint(14, 17), "between"]]
    cfg = faults_run.Config(out=str(tmp_path), groups=3, docs=420, async_quorum=async_quorum, kills=kills,
                            rejoin_seconds=0.5)  # fmt: skip
    result = faults_run.run(cfg)
    steps = check_run(cfg, result)
    assert all(result["lives"][g] == 1 for g in range(3)), result["lives"]  # every kill happened
    rejoined = [rec for rec in result["lines"] if rec["life"] == 1 and rec["committed"] and rec["plan"]]
    assert rejoined, "no killed group contributed again after its restart"
    assert any(len(s["contributors"]) < 3 for s in steps.values())  # steps with a group missing
    reference = faults_run.replay(cfg, steps)
    for g in result["finished"]:
        got = torch.load(Path(cfg.out) / f"final_g{g}.pt")
        assert max(float((got[k] - reference[k]).abs().max()) for k in reference) < 1e-9


def test_context_parallel_ranks_of_a_group_get_the_same_micro_batches(tmp_path):
    cfg = faults_run.Config(out=str(tmp_path), groups=2, cp=2, docs=200, train=False, max_tokens=64)
    result = faults_run.run(cfg)
    check_run(cfg, result)
    by = {}
    for rec in result["lines"]:
        if rec["committed"]:
            by.setdefault((rec["committed_before"], rec["group"]), {})[rec["rank"]] = rec
    per_step = {}
    for (step, _), ranks in by.items():
        if step > 0:  # step 0: torchft's init_sync heals per rank from different groups (faults_run.states_agree)
            assert ranks[0]["mine"] == ranks[1]["mine"]  # the group's micro-batches, CP-sharded by the collator
        per_step.setdefault(step, [0, ranks[0]["loss_tokens"]])
        per_step[step][0] += ranks[0]["my_loss_tokens"]  # the collator counts a micro-batch's, all CP ranks
    assert all(total == expected for total, expected in per_step.values()), per_step


def test_a_replica_that_slows_down_is_noticed_and_given_less_work(tmp_path):
    """Adapt mode, a BalanceMonitor attached to every process: group g1's device runs at half speed from committed
    step 8 on (benchmarks/faults_run.py sleeps its device time twice as long); every group's report names it by its
    replica_id within a few steps, and the steps after that give it less of the step's cost than g0."""
    cfg = faults_run.Config(out=str(tmp_path), groups=2, docs=300, mode="adapt", work=20.0, slow={"1": [8, 1.0]},
                            train=False, monitor="adapt")  # fmt: skip
    result = faults_run.run(cfg)
    check_run(cfg, result)
    for final in result["finals"]:  # each process's BalanceMonitor measured the committed steps its group ran
        ran = sorted(r["committed_before"] for r in result["lines"] if (r["group"], r["rank"]) == (final["group"],
                     final["rank"]) and r["committed"] and r["mine"])  # fmt: skip
        assert final["monitor"]["steps"] == ran and len(ran) > 10, final["monitor"]
    for final in result["finals"]:
        slowed = [e for e in final["report"]["slowed"] if e["replica_id"] == "g1"]
        assert slowed and 8 <= slowed[0]["step"] <= 8 + 5, final["report"]["slowed"]
        assert not [e for e in final["report"]["slowed"] if e["replica_id"] == "g0"]
        later = [s for s in final["log"] if s["committed_steps"] > slowed[0]["step"] + 1 and s["speeds"]]
        assert later, "no step was planned with the measured speeds after the slowdown"
        for s in later:
            costs = dict(zip(s["contributors"], s["costs"]))
            assert costs["g1"] < 0.8 * costs["g0"], s
