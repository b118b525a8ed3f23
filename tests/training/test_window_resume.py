"""Windowed sampler resume: exact at every micro-batch (inside windows and across their boundaries), elastic onto
other topologies at window boundaries and inside windows, strict state parsing (format_version 3, versions 1 and 2 still
loads), and memory-mapped lengths that stay mapped and are never copied whole."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from support.coverage import covered_tokens

import balancer
from balancer.training.indices import Span

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
TOPO = balancer.Topology(dp=4, cp=2, micro_batches=2, max_tokens=256, tokens_per_step=2800)
rng = np.random.default_rng(7)
LENGTHS = rng.integers(1, 120, 400)
LENGTHS[rng.choice(400, 10, replace=False)] = rng.integers(200, 512, 10)
WINDOW = 100


def _sampler(topo=TOPO, rank=0, lengths=LENGTHS, **kw):
    kw.setdefault("window_docs", WINDOW)
    return balancer.BalancedBatchSampler(lengths, topo, COST, dp_rank=rank, seed=2, **kw)


def _key(i, lengths):
    return (i.doc, i.start, i.end) if isinstance(i, Span) else (int(i), 0, int(lengths[i]))


@pytest.mark.slow  # ~2 s
def test_resume_at_every_micro_batch_across_windows():
    s = _sampler(rank=3)
    s.set_epoch(1)
    full = list(s)
    assert s.num_windows == 4
    bounds = np.cumsum([s.windows.steps(w) * TOPO.micro_batches for w in range(4)])
    for cut in range(len(full) + 1):
        a = _sampler(rank=3)
        a.set_epoch(1)
        it = iter(a)
        head = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(a.state_dict()))
        w = int(np.searchsorted(bounds, cut, side="right"))
        assert state["window"] == min(w, 3)  # at a boundary the state names the next window, position 0
        b = _sampler(rank=3)
        b.load_state_dict(state)
        b.set_epoch(1)
        assert head + list(b) == full, cut
        assert list(b) == full  # the next pass is the whole epoch again


@pytest.mark.slow  # ~2 s per case
@pytest.mark.parametrize("overflow", ["error", "split"])
def test_elastic_resume_inside_and_at_window_boundaries(overflow):
    lengths = LENGTHS if overflow == "error" else np.concatenate([LENGTHS, [900, 1500]])
    topo2 = balancer.Topology(dp=2, cp=2, micro_batches=3, max_tokens=256, tokens_per_step=2800)
    old = [_sampler(rank=r, lengths=lengths, overflow=overflow) for r in range(TOPO.dp)]
    for s in old:
        s.set_epoch(1)
    full = [list(s) for s in old]
    want = covered_tokens([i for mbs in full for mb in mbs for i in mb], lengths)
    assert set(want.values()) == {1}
    m = TOPO.micro_batches
    first = old[0].windows.steps(0)
    for k in sorted({1, first - 1, first, first + 1, old[0].num_steps - 1}):
        consumed = [i for mbs in full for mb in mbs[: k * m] for i in mb]
        state = old[0].state_dict(position=k * m)
        new = [_sampler(topo2, r, lengths, overflow=overflow, window_docs=24) for r in range(topo2.dp)]
        for s in new:
            s.load_state_dict(state)  # the epoch keeps the state's windows, whatever window_docs the sampler has
        window_plan = new[0].plan  # the re-planned rest of the window, global ids and token ranges
        planned = {(int(d), int(a), int(b)) for d, a, b in zip(window_plan.doc, window_plan.start, window_plan.end)}
        rest = [list(s) for s in new]
        assert len({len(r) for r in rest}) == 1 and len(rest[0]) == new[0].num_steps * topo2.micro_batches
        assert len(rest[0]) == len(new[0])  # exact, also after an elastic resume
        n_first = window_plan.num_steps * topo2.micro_batches
        yielded = {_key(i, lengths) for r in rest for mb in r[:n_first] for i in mb}
        assert yielded == planned
        got = covered_tokens(consumed + [i for mbs in rest for mb in mbs for i in mb], lengths)
        assert got == want, f"step {k}: tokens lost or repeated"
        # and on again, from inside the re-planned window, back to the first topology
        if len(rest[0]) >= topo2.micro_batches:
            state2 = new[0].state_dict(position=topo2.micro_batches)
            consumed2 = consumed + [i for mbs in rest for mb in mbs[: topo2.micro_batches] for i in mb]
            back = [_sampler(rank=r, lengths=lengths, overflow=overflow) for r in range(TOPO.dp)]
            for s in back:
                s.load_state_dict(state2)
            rest3 = [list(s) for s in back]
            assert covered_tokens(consumed2 + [i for mbs in rest3 for mb in mbs for i in mb], lengths) == want


def test_state_parsing_is_strict():
    s = _sampler()
    good = s.state_dict()
    assert good["format"] == "balancer.sampler" and good["format_version"] == 3
    cases = [
        ({**good, "extra": 1}, '"extra": unknown key'),
        ({**good, "position": True}, '"position": expected an integer >= 0, got true'),
        ({**good, "window": 1.0}, '"window": expected an integer'),
        ({**good, "window": 4}, '"window": 4 is out of range'),
        ({**good, "window_docs": 0}, '"window_docs": expected an integer >= 1, got 0'),
        ({**good, "format_version": 4}, "newer than this balancer reads"),
        ({**good, "format_version": "2"}, '"format_version": expected an integer'),
        ({k: v for k, v in good.items() if k != "format_version"}, 'missing key "format_version"'),
        ({k: v for k, v in good.items() if k != "window"}, 'missing key "window"'),
        ({**good, "overflow": 1}, '"overflow": expected one of'),
        ({**good, "segments": [{**good["segments"][0], "steps": 3}]}, r'"segments\[0\].steps": expected null'),
        ({**good, "segments": [{**good["segments"][0], "x": 1}]}, r'"segments\[0\].x": unknown key'),
    ]
    for state, match in cases:
        with pytest.raises(ValueError, match=match):
            _sampler().load_state_dict(state)


def test_version_1_state_still_loads_as_a_whole_epoch():
    whole = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=2, window_docs=len(LENGTHS))
    whole.set_epoch(1)
    full = list(whole)
    v1 = {
        "format": "balancer.sampler/1",
        "epoch": 1,
        "position": 3,
        "seed": 2,
        "overflow": "error",
        "fingerprint": whole.fingerprint,
        "num_docs": len(LENGTHS),
        "dp_rank": 1,
        "rank": 2,
        "segments": [{"topology": TOPO.to_dict(), "cost": COST.to_dict(), "steps": None}],
    }
    s = _sampler(rank=1)  # a windowed sampler: the resumed epoch is the state's whole-epoch plan
    s.load_state_dict(v1)
    assert list(s) == full[3:]
    s.set_epoch(2)
    assert s.num_windows == 4  # later epochs use the sampler's own windows
    with pytest.raises(ValueError, match="format"):
        _sampler().load_state_dict({**v1, "format": "balancer.sampler/2"})
    with pytest.raises(ValueError, match='"window_docs": not part of format_version 1'):
        _sampler().load_state_dict({**v1, "window_docs": 100})


def test_memmap_lengths_stay_mapped_and_are_never_copied(tmp_path):
    n = 4_000_000
    path = tmp_path / "lengths.npy"
    np.save(path, np.random.default_rng(0).integers(50, 400, n).astype(np.int64))
    topo = balancer.Topology(dp=8, cp=1, micro_batches=4, max_tokens=4096, tokens_per_step=8 * 4 * 3000)
    lengths = np.load(path, mmap_mode="r")
    for source in (lengths, str(path)):
        tracemalloc.start()
        s = balancer.BalancedBatchSampler(source, topo, COST, dp_rank=5, seed=0, window_docs=20_000)
        first = next(iter(s))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert isinstance(s.lengths, np.memmap)
        assert len(first) > 0 and s.num_windows == n // 20_000
        assert peak < n * 8 // 3, f"peak {peak / 2**20:.1f} MiB for {n * 8 / 2**20:.0f} MiB of lengths"
