"""`piece_sizes`: the token counts (and a dynamic plan's CP group) that the monitor reads from every step source
without building the indices equal what `micro_batch`'s pieces give, for every step, slot and rank: samplers
(static, CP with split documents, filler rows, dynamic CP), BatchSteps (static and dynamic) and StreamSteps (one
process; its dynamic path runs in test_stream_steps.py's world). The monitor read sizes from the indices before,
and a filler row there stopped `end_step` with an IndexError (test_a_monitor_on_filler_rows_measures_the_last_step)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from support.dist import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

import balancer  # noqa: E402
from balancer.measured import BalanceMonitor, StreamSteps  # noqa: E402
from balancer.measured.batches import BatchSteps  # noqa: E402
from balancer.streaming import BalancedStream  # noqa: E402

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
_rng = np.random.default_rng(5)
LENGTHS = np.concatenate([_rng.integers(1, 300, 500), _rng.integers(1500, 3000, 10)])[_rng.permutation(510)]
DYNAMIC = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=1024, tokens_per_step=2600, cp_sizes=(1, 2, 4))


def _reference(items, lengths, rank: int, dynamic: bool):
    """What the monitor read before: each piece's tokens, and the group its first piece carries."""
    sizes = [(i.end - i.start) if hasattr(i, "end") else int(lengths[getattr(i, "row", i)]) for i in items]
    sizes = np.array(sizes, dtype=np.int64)
    if not dynamic:
        return sizes, None
    return sizes, ((items[0].group.start, items[0].group.size) if len(items) else (rank, 1))


def _same(source, step: int, lengths, topo) -> int:
    """Compare every slot of `step` on every unit of `source`; returns the slots compared."""
    n = 0
    for m in range(source.step_micro_batches(step)):
        for unit in range(topo.pool_size if topo.dynamic else topo.dp):
            key = {"rank": unit} if topo.dynamic else {"dp_rank": unit}
            got = source.piece_sizes(step, m, **key)
            want = _reference(source.micro_batch(step, m, **key), lengths, unit, topo.dynamic)
            assert got[0].tolist() == want[0].tolist() and got[1] == want[1], (step, m, unit)
            n += 1
    return n


@pytest.mark.parametrize(
    "lengths, topo, options",
    [
        (LENGTHS, balancer.Topology(dp=2, micro_batches=3, max_tokens=4096), {}),
        (LENGTHS, balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=1024), {"overflow": "split"}),
        (np.full(21, 8), balancer.Topology(dp=4, micro_batches=2, max_tokens=8), {"filler_rows": True}),
        (LENGTHS, DYNAMIC, {}),
    ],
    ids=["static", "cp2-split", "filler-rows", "dynamic"],
)
def test_the_sampler_reads_what_its_micro_batches_hold(lengths, topo, options):
    opts = {"window_docs": 100, **options} if len(lengths) > 100 else options
    sampler = balancer.BalancedBatchSampler(lengths, topo, COST, rank=0, seed=3, **opts)
    seg = sampler.segment
    if options.get("filler_rows"):  # 21 rows on dp 4 x 2: the last step holds 3 filler rows
        assert seg.filler is not None and seg.filler.sum() == 3
    if options.get("overflow"):
        assert np.any(seg.end - seg.start < seg.full)
    assert sum(_same(sampler, step, lengths, topo) for step in range(sampler.num_steps)) > 0
    with pytest.raises(IndexError):
        sampler.piece_sizes(sampler.num_steps, 0, dp_rank=0)


@pytest.mark.parametrize("topo", [balancer.Topology(dp=2, micro_batches=2, max_tokens=4096), DYNAMIC])
def test_batch_steps_read_what_their_micro_batches_hold(topo):
    steps = BatchSteps(topo, COST, rank=0)
    BalanceMonitor(steps, mode="shadow")
    n = 0
    for b in range(3):
        lengths = np.random.default_rng(b).integers(20, 900, 16)
        plan = balancer.balance_batch(lengths, steps.next_model()[0], COST, mini_batches=2)
        steps.add(plan)
        first = steps.num_steps - plan.num_steps
        n += sum(_same(steps, first + s, None, topo) for s in range(plan.num_steps))
    assert n > 0


@pytest.mark.parametrize("topo", [balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)])
def test_stream_steps_read_what_their_micro_batches_hold(topo):
    rows = doc_rows(240, 4, long_every=9, long_len=1000)
    stream = BalancedStream(rows, topo, COST, window_docs=60)
    steps = StreamSteps(stream)
    BalanceMonitor(steps, mode="shadow", cuda=False)
    n = 0
    for j, _ in enumerate(stream):
        if j % topo.micro_batches == topo.micro_batches - 1:  # the step just yielded is still kept
            n += _same(steps, j // topo.micro_batches, None, topo)
    assert n > 0


def _filler_world(rank: int, world: int) -> None:
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=8)  # 21 rows: a last step of 5 rows and 3 fillers
    sampler = balancer.BalancedBatchSampler(np.full(21, 8), topo, COST, dp_rank=rank, filler_rows=True)
    assert [sampler.step_micro_batches(s) for s in range(sampler.num_steps)] == [2, 2, 2]
    monitor = BalanceMonitor(sampler, mode="shadow", warmup_steps=0)
    for j, _ in enumerate(sampler):
        monitor.record(1e-3)
        if j % 2 == 1:
            monitor.end_step()
    monitor.flush()
    assert sampler.segment.filler.any(), "the case needs filler rows"
    assert [s["step"] for s in monitor.ledger.steps] == list(range(sampler.num_steps))  # the filler step too


def test_a_monitor_on_filler_rows_measures_the_last_step():
    run_world(4, _filler_world)
