"""balancer.distributed on real spawned gloo worlds (2 and 3 processes): every rank computes the same plan as the
single-process balance_batch of the gathered batch, and exchange() delivers exactly the documents of the rank's
replica (or CP groups), with their tokens, by all-to-all and by point-to-point."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.dist import run_world  # noqa: E402

import balancer  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process gloo

COST = balancer.CostModel(attn_coef=1 / 1000, linear_coef=1.0)


def _local_batch(rank: int, seed: int):
    """This rank's rollouts: a rank-dependent count, lengths 5..120, groups of two (ids shared by all ranks)."""
    rng = np.random.default_rng([seed, rank])
    n = 2 * int(rng.integers(4 + rank, 9 + rank))
    lengths = rng.integers(5, 121, n)
    groups = 1000 * rank + np.repeat(np.arange(n // 2), 2)
    tokens = [torch.arange(int(n_tok), dtype=torch.int64) + 10_000 * rank + 100 * i for i, n_tok in enumerate(lengths)]
    return lengths, groups, tokens


def _worker(rank, world, cfg):
    from balancer.distributed import balance_batch, exchange

    topo = balancer.Topology(**cfg["topology"])
    lengths, groups, tokens = _local_batch(rank, cfg["seed"])
    kwargs = dict(groups=groups if cfg["groups"] else None, keep=cfg.get("keep", "rank"), micro_batches="auto")
    plan, send, recv = balance_batch(lengths, topo, COST, mini_batches=cfg["k"], **kwargs)
    # the reference: the whole batch on one process, in rank order
    parts = [_local_batch(r, cfg["seed"]) for r in range(world)]
    all_lengths = np.concatenate([p[0] for p in parts])
    all_groups = np.concatenate([p[1] for p in parts]) if cfg["groups"] else None
    want = balancer.balance_batch(all_lengths, topo, COST, mini_batches=cfg["k"], **{**kwargs, "groups": all_groups})
    assert np.array_equal(plan.doc, want.doc) and np.array_equal(plan.mb_ptr, want.mb_ptr)
    plan.validate()
    offsets = np.concatenate([[0], np.cumsum([len(p[0]) for p in parts])])
    mine = _docs_of(plan, rank, world)
    assert sorted(d for ids in recv for d in ids) == sorted(mine)
    for method in ("all_to_all", "p2p"):
        got = exchange(tokens, send, recv, plan.lengths, method=method)
        assert sorted(got) == sorted(mine)
        for d, tensor in got.items():
            src = int(np.searchsorted(offsets, d, side="right") - 1)
            assert torch.equal(tensor, parts[src][2][d - offsets[src]]), (method, d)
    # every document goes to exactly one replica (static) or the ranks of its groups (dynamic)
    counts = torch.zeros(plan.num_docs, dtype=torch.int64)
    counts[sorted(mine)] = 1
    dist.all_reduce(counts)
    per = 1 if plan.dynamic else world // topo.dp
    assert counts.min() >= per


def _docs_of(plan, rank, world):
    t = plan.topology
    if plan.dynamic:
        return sorted({d for step in plan.pool_view(rank) for _, docs in step for d in docs})
    dp_rank = rank // (world // t.dp)
    return sorted({d for step in plan.rank_view(dp_rank) for mb in step for d in mb})


CONFIGS = {
    "2 ranks dp2": (2, dict(topology=dict(dp=2, max_tokens=512), groups=False, k=1, seed=0)),
    "2 ranks dp1 x cp2, 2 mini-batches": (2, dict(topology=dict(dp=1, cp=2, max_tokens=256), groups=True, k=2, seed=1)),
    "3 ranks dp3, groups in a micro-batch": (
        3,
        dict(topology=dict(dp=3, max_tokens=512), groups=True, keep="micro_batch", k=1, seed=2),
    ),
    "2 ranks dynamic cp": (
        2,
        dict(topology=dict(dp=1, cp=2, max_tokens=256, cp_sizes=(1, 2)), groups=True, k=1, seed=3),
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_distributed_balance_batch_and_exchange(name):
    world, cfg = CONFIGS[name]
    run_world(world, _worker, cfg)


def test_imports_stay_light():
    import subprocess

    code = "import sys, balancer.distributed; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _bad_input_worker(rank, world):
    """Bad input on one rank: every rank raises the same ValueError naming that rank and the reason (before this
    check the bad rank raised alone and the others failed in the all-gather with a closed connection, or planned
    silently truncated lengths); ranks that disagree on an option are refused, naming it."""
    from balancer.distributed import balance_batch

    topo = balancer.Topology(dp=2, max_tokens=512)
    good = np.array([10, 20, 30, 40])
    cases = [
        ({1: dict(local_lengths=np.array([10.0, np.nan]))}, "rank 1: local_lengths[1] = nan"),
        ({1: dict(local_lengths=np.array([10.0, 2.5]))}, "rank 1: local_lengths[1] = 2.5"),
        ({0: dict(local_lengths=np.array([10, -3, 4]))}, "rank 0: local_lengths[1] = -3"),
        ({1: dict(groups=np.arange(3))}, "rank 1: groups must hold one group id per local document"),
        ({1: dict(groups=np.full(4, 0.5))}, "rank 1: groups must hold integer group ids"),
        ({1: dict(seed=1)}, "seed differs between ranks (rank 0: 0, rank 1: 1)"),
        ({1: dict(topology=balancer.Topology(dp=2, max_tokens=256))}, "topology differs between ranks"),
        ({0: dict(groups=np.zeros(4, dtype=np.int64))}, "groups differs between ranks"),
        ({1: dict(cost="not a cost")}, "rank 1: cost must be a balancer.CostModel"),
    ]
    for bad, want in cases:
        args = dict(local_lengths=good, topology=topo, cost=COST, groups=None, seed=0)
        args.update(bad.get(rank, {}))
        with pytest.raises(ValueError) as caught:
            balance_batch(args.pop("local_lengths"), args.pop("topology"), args.pop("cost"), **args)
        assert want in str(caught.value), (rank, str(caught.value))
        assert str(caught.value).startswith("balancer.distributed.balance_batch: ")
    plan, _, _ = balance_batch(good, topo, COST)  # the world still works after every refusal
    assert plan.num_docs == 2 * len(good)


def test_bad_input_on_one_rank_stops_every_rank_with_the_reason():
    run_world(2, _bad_input_worker)
