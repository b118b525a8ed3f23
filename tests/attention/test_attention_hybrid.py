"""cp_attention on the hybrid layout (short documents whole on one rank, long ones zigzag-split) on real gloo worlds
of 2, 3 and 4 processes: forward and all three gradients against the float64 reference, and the bytes each rank
sends: only the split documents' K/V (and their gradients) travel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.dist import run_world
from test_attention_cp import check_case

from attention import CPLayout, bytes_sent, cp_attention, reset_bytes_sent

pytestmark = pytest.mark.slow  # multi-process gloo


def _tight(extra: int):
    """max_tokens = the even share of the batch plus ``extra`` tokens (forces splits of what does not fit)."""
    return lambda total, cp: -(-total // cp) + extra


# (lengths, layout options): automatic split, explicit thresholds, a max_tokens that forces a split, all whole,
# all split, one-token and empty documents, fewer documents than ranks (empty ranks)
CASES = [
    ([5, 300, 7, 9, 40, 1, 3], {}),
    ([64, 12, 33, 2, 90, 17], {"split_threshold": 30}),
    ([20, 20, 20, 20, 21], {"max_tokens": _tight(2)}),
    ([11, 13, 0, 7], {"split_threshold": 100}),
    ([9, 1, 26], {"split_threshold": 1}),
    ([40], {"split_threshold": 1000}),
    ([3, 45, 2], {"split_threshold": 10, "max_tokens": _tight(4)}),
]


def _options(opts: dict, lens, cp: int) -> dict:
    return {k: (v(int(sum(lens)), cp) if callable(v) else v) for k, v in opts.items()}


def _worker(rank, world):
    n = 0
    for i, (lens, opts) in enumerate(CASES):
        heads, kv_heads = [(2, 2), (4, 2), (4, 1), (6, 3)][i % 4]
        # float64 both masks, float32 one (alternating), both methods
        for dtype, causal in ((torch.float64, True), (torch.float64, False), (torch.float32, i % 2 == 0)):
            for method in ("ring", "allgather"):
                check_case(
                    rank, world, np.array(lens), heads, kv_heads, 8, dtype, causal, method,
                    kind="hybrid", layout_opts=_options(opts, lens, world), head_chunks=1 + i % 2, seed=i,
                )  # fmt: skip
                n += 1
    assert n == 6 * len(CASES)
    # sliding windows and softcap: windowed blocks against the travelling K/V
    for window, softcap in (((5, -1), 0.0), ((3, 2), 1.5)):
        for method in ("ring", "allgather"):
            check_case(
                rank, world, np.array([40, 3, 17, 9, 25]), 4, 2, 8, torch.float64, window[1] < 0, method,
                kind="hybrid", layout_opts={"split_threshold": 10}, window=window, softcap=softcap,
            )  # fmt: skip
    if world == 3:
        _check_bytes(rank, world)


def _expected_bytes(layout: CPLayout, rank: int, method: str, heads_kv: int, dim: int, elem: int) -> int:
    """Forward + backward bytes this rank sends: ring: c-1 K/V hops forward, c-1 K/V and c-1 dK/dV hops backward
    (dK/dV in the accumulation dtype); allgather: (c-1) x the padded block, forward, backward, and reduce-scatter."""
    c, counts = layout.cp_size, layout.kv_counts
    row = 2 * heads_kv * dim * elem  # K and V of one token
    if method == "ring":
        kv = sum(int(counts[(rank - i) % c]) for i in range(c - 1))  # blocks r, r-1, ..., r-c+2 pass on
        dkv = sum(int(counts[(rank - i) % c]) for i in range(1, c))  # gradients of blocks r-1, ..., r-c+1
        return (2 * kv + dkv) * row  # float64: dK/dV travel in the same dtype
    return 3 * (c - 1) * int(counts.max()) * row


def _check_bytes(rank, world):
    """Bytes sent match the layout: zero when every document is whole, only split documents otherwise."""
    lens = np.array([30, 7, 50, 3, 12, 200, 9, 1])
    cu = np.concatenate([[0], np.cumsum(lens)])
    for opts in ({"split_threshold": 1000}, {"split_threshold": 40}, {"split_threshold": 1}):
        layout = CPLayout.build(cu, world, kind="hybrid", **opts)
        for method in ("ring", "allgather"):
            g = torch.Generator().manual_seed(0)
            T = int(cu[-1])
            q, k, v = (
                torch.randn(T, 4, 8, generator=g),
                torch.randn(T, 2, 8, generator=g),
                torch.randn(T, 2, 8, generator=g),
            )
            x = [layout.shard(t, rank).double().requires_grad_() for t in (q, k, v)]
            reset_bytes_sent()
            cp_attention(*x, layout, method=method).sum().backward()
            got = bytes_sent()
            assert got == _expected_bytes(layout, rank, method, 2, 8, 8), (opts, method, got)
            if opts["split_threshold"] == 1000:
                assert got == 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_hybrid_cp_attention_matches_reference(world):
    """Exact forward/backward on every world; on world 3 also the bytes each rank sends."""
    run_world(world, _worker)


def test_collator_hybrid_layout():
    """PackedCollator(layout="hybrid" or a spec dict): every rank's shard comes from the same hybrid layout, the
    shards unshard to the packed batch, and a bad option fails at construction naming it."""
    from balancer.training.collate import PackedCollator

    g = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(0, 100, (n,), generator=g)} for n in (5, 90, 7, 12, 3, 40)]
    for spec in ("hybrid", {"kind": "hybrid", "split_threshold": 10}):
        outs = [PackedCollator(cp_rank=r, cp_size=3, layout=spec)(items) for r in range(3)]
        lay = outs[0]["layout"]
        assert lay.kind == "hybrid" and all(o["layout"].fingerprint() == lay.fingerprint() for o in outs)
        if isinstance(spec, dict):
            assert lay.split_docs.tolist() == [False, True, False, True, False, True]
        ids = lay.unshard([o["input_ids"][0] for o in outs])
        assert torch.equal(ids, torch.cat([it["input_ids"] for it in items]))
        assert all(torch.equal(o["position_ids"][0], torch.from_numpy(lay.position_ids(r))) for r, o in enumerate(outs))
    assert PackedCollator(cp_size=2).layout_spec == {"kind": "zigzag"}
    assert PackedCollator(cp_size=2, layout="hybrid").layout_spec["split_threshold"] is None
    with pytest.raises(ValueError, match="split_threshold"):
        PackedCollator(cp_size=2, layout={"kind": "hybrid", "split_threshold": 0})
    with pytest.raises(ValueError, match="layout must be one of"):
        PackedCollator(cp_size=2, layout="ring")
