"""`StreamSteps`: a `BalanceMonitor` on a `BalancedStream` in a real 2-process gloo world over a JSONL `datasets`
streaming source, with synthetic deterministic times (replica 1 twice as slow): adapt mode refits to the same
figures and the same window plans on every rank and plans the windows from the fitted one + 2 on with the fit; a
stream and monitor resumed from a mid-window state yield what the uninterrupted run does (a refit before it);
shadow mode changes no plan. One world runs all three (module fixture); the single-process checks are below."""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import as_lists, doc_rows, make_source, write_shards  # noqa: E402
from support.dist import run_world  # noqa: E402

pytestmark = pytest.mark.slow

TOPO = {"dp": 2, "micro_batches": 2, "max_tokens": 384}
SLOW = 2.0  # replica 1's times are scaled by this
PER_RANK_KEYS = ("refits", "monitor_cpu_seconds", "refit_cpu_seconds")  # rank 0 refits; CPU times are local


def _seconds(mb: list, slow: bool) -> float:
    """A deterministic time of a micro-batch from its documents alone: linear and quadratic in their lengths."""
    n = np.array([len(r["input_ids"]) for r in mb], dtype=np.float64)
    return float((1e-3 + 2e-5 * n.sum() + 4e-8 * (n * n).sum()) * (SLOW if slow else 1.0))


def _digest(seg) -> str:
    h = hashlib.sha256()
    for a in (seg.doc, seg.start, seg.end, seg.mb_ptr):
        h.update(np.asarray(a, dtype="<i8").tobytes())
    h.update(json.dumps(seg.cost.to_dict(), sort_keys=True).encode())
    h.update(repr(seg.topology.rank_speeds).encode())
    return h.hexdigest()[:16]


def _run(cfg: dict, mode, state=None, stop=None, probe=None) -> dict:
    """Iterate a fresh stream (with a monitor of `mode`, None: none), optionally resumed from `state`, timing
    every micro-batch; `probe(windows so far, monitor)` -> True at a step boundary saves the state there."""
    import balancer
    from balancer.measured import BalanceMonitor, StreamSteps
    from balancer.streaming import BalancedStream

    stream = BalancedStream(
        make_source(cfg), balancer.Topology(**TOPO), balancer.CostModel(1.0, 50.0), window_docs=cfg["window_docs"]
    )
    monitor = None
    if mode is not None:
        monitor = BalanceMonitor(StreamSteps(stream), mode=mode, warmup_steps=0, min_samples=8, cuda=False)
    if state is not None:
        stream.load_state_dict(json.loads(state))
    m, slow = TOPO["micro_batches"], stream.dp_rank == 1
    got, windows, saved, plans = [], [], None, {}
    it = iter(stream)
    for j, mb in enumerate(it):
        got.append(mb)
        windows.append(it.win.index)
        plans.update({w: _digest(seg) for w, (_, seg) in it.plans.items()})
        if monitor is not None:
            monitor.record(_seconds(mb, slow))
            if (j + 1) % m == 0:
                monitor.end_step()
        if probe is not None and saved is None and (j + 1) % m == 0 and probe(windows, monitor):
            saved = (j + 1, json.dumps(stream.state_dict()))  # after micro-batch j (and its step's end_step)
    out = {"batches": as_lists(got), "windows": windows, "saved": saved, "plans": plans}
    if monitor is not None:
        monitor.flush()
        report = monitor.report()
        out["report"] = json.dumps({k: v for k, v in report.items() if k not in PER_RANK_KEYS}, sort_keys=True)
        out["models"] = [(tuple(x.start), x.cost.to_dict(), x.plan_speeds) for x in monitor.models]
        out["stream_models"] = {w: stream.model_for(w) for w in range(max(windows) + 1)}
        out["monitor_models"] = {w: monitor.model_for(0, w) for w in range(max(windows) + 1)}
        out["accepted"] = sum(r["accepted"] for r in monitor.refits)
    return out


def _after_first_fit(windows: list, monitor) -> bool:
    """Mid-window (a step in) of the window after the one the first fit plans from (the fit in force)."""
    if monitor is None or len(monitor.models) < 2:
        return False
    first = monitor.models[1].start[1]
    return len(windows) > 4 and windows[-1] == first and windows[-3] == first and windows[-4] == first


def _world_body(rank: int, world: int, cfg: dict, out: str) -> None:
    adapt = _run(cfg, "adapt", probe=_after_first_fit)
    j, state = adapt["saved"]
    resumed = _run(cfg, "adapt", state=state)
    results = {
        "adapt": adapt,
        "resumed": resumed,
        "shadow": _run(cfg, "shadow"),
        "plain": _run(cfg, None),
    }
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream_steps")
    rows = doc_rows(360, 3)
    paths = write_shards(tmp / "data", rows, [100, 80, 120, 60], "jsonl")
    cfg = {"source": "jsonl", "paths": paths, "window_docs": 40}
    out = tmp / "out"
    out.mkdir()
    run_world(2, _world_body, cfg, str(out))
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def test_adapt_refits_alike_on_every_rank_and_plans_from_the_fitted_window_plus_two(world):
    a, b = world[0]["adapt"], world[1]["adapt"]
    assert a["accepted"] >= 1 and a["report"] == b["report"] and a["models"] == b["models"]
    assert a["plans"] == b["plans"] and a["stream_models"] == b["stream_models"]
    start, cost, speeds = a["models"][1]
    assert speeds is not None and speeds[1] < speeds[0]  # replica 1 is the slow one
    first = start[1]
    assert first >= 2 and max(a["windows"]) > first  # the fit after window first - 2 reaches windows first..
    initial = a["stream_models"][0]
    for w, (topology, c) in a["stream_models"].items():
        assert (topology, c) == a["monitor_models"][w]  # the stream plans what the monitor predicts with
        if w < first:
            assert (topology, c) == initial
    topology, c = a["stream_models"][first]
    assert c.to_dict() == cost and topology.rank_speeds == tuple(speeds)
    report = json.loads(a["report"])
    assert report["models"][1]["from"] == list(start) and report["measured_imbalance"] > 1.0


def test_a_resumed_stream_and_monitor_continue_exactly(world):
    for rank in world:
        a, r = rank["adapt"], rank["resumed"]
        j, _ = a["saved"]
        assert 0 < j < len(a["batches"]) and j % TOPO["micro_batches"] == 0
        first = a["models"][1][0][1]
        assert a["windows"][j - 4 : j + 1] == [first] * 5  # mid-window: the window the fit plans from
        assert r["batches"] == a["batches"][j:]  # the same remaining micro-batches, planned with the fit
        assert r["models"] == a["models"] and r["report"] == a["report"]  # and the same fits after the resume
    states = [json.loads(rank["adapt"]["saved"][1]) for rank in world]
    for st in states:  # the first rank refits (its records); CPU times are each rank's own
        st["monitor"] = {k: v for k, v in st["monitor"].items() if k not in ("refits", "cpu_seconds", "refit_seconds")}
    assert states[0] == states[1] and states[0]["monitor"]["models"]  # one state on every rank, the fit in it


def test_shadow_changes_no_plan(world):
    for rank in world:
        shadow, plain = rank["shadow"], rank["plain"]
        assert len(shadow["models"]) >= 2  # it fitted (every rank has the fits), and kept every plan
        assert shadow["batches"] == plain["batches"] and shadow["plans"] == plain["plans"]
        assert all(m == shadow["stream_models"][0] for m in shadow["stream_models"].values())
    assert world[0]["shadow"]["report"] == world[1]["shadow"]["report"]


def test_stream_steps_refusals():
    import balancer
    from balancer.measured import BalanceMonitor, StreamSteps
    from balancer.streaming import BalancedStream

    cost = balancer.CostModel(1.0, 50.0)
    with pytest.raises(TypeError, match="BalancedStream"):
        StreamSteps([1, 2, 3])
    stream = BalancedStream(doc_rows(20, 0), balancer.Topology(dp=1, micro_batches=2, max_tokens=512), cost,
                            window_docs=8)  # fmt: skip
    BalanceMonitor(StreamSteps(stream), cuda=False)
    with pytest.raises(ValueError, match="already has a BalanceMonitor"):
        StreamSteps(stream)


def test_a_fit_for_a_window_already_planned_is_an_error():
    """Windows of one step: the fit after window w arrives at the first step of w + 1, when w + 2 is already
    handed to the planning thread."""
    import balancer
    from balancer.measured import BalanceMonitor, StreamSteps
    from balancer.streaming import BalancedStream

    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)
    stream = BalancedStream(doc_rows(200, 1), topo, balancer.CostModel(1.0, 50.0), window_docs=4)
    monitor = BalanceMonitor(StreamSteps(stream), mode="adapt", warmup_steps=0, min_samples=8, cuda=False)
    with pytest.raises(RuntimeError, match="handed to its planning thread"):
        for j, mb in enumerate(stream):
            monitor.record(_seconds(mb, False))
            if j % 2 == 1:
                monitor.end_step()


def test_the_fit_after_a_pass_s_last_window_plans_the_next_pass():
    """The last window's fit arrives with the next pass's first gather: it plans that pass from its first window
    not handed to the planning thread yet (not a window of the pass that ended). The evidence first suffices at
    the last window (16 micro-batches), so that fit replaces the FLOP model (the times are noiseless: a later fit
    of the same exact model would tie with the one in force, in the last bits, and be refused)."""
    import balancer
    from balancer.measured import BalanceMonitor, StreamSteps
    from balancer.streaming import BalancedStream

    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)
    stream = BalancedStream(doc_rows(240, 2), topo, balancer.CostModel(1.0, 50.0), window_docs=60)
    monitor = BalanceMonitor(StreamSteps(stream), mode="adapt", warmup_steps=0, min_samples=16, cuda=False)
    for epoch in range(2):
        stream.set_epoch(epoch)
        for j, mb in enumerate(stream):
            monitor.record(_seconds(mb, False))
            if j % 2 == 1:
                monitor.end_step()
    last = [r for r in monitor.refits if r["epoch"] == 0][-1]
    assert last["accepted"]
    moved = [m for m in monitor.models if m.start[0] == 1]
    assert moved and moved[0].start[1] >= 1  # the first window of pass 1 was planned before the fit arrived
    assert stream.model_for(moved[0].start[1])[1] == moved[0].cost  # later fits start later


def _dynamic_body(rank: int, world: int, out: str) -> None:
    import balancer
    from balancer.measured import BalanceMonitor, StreamSteps
    from balancer.streaming import BalancedStream

    topo = balancer.Topology(dp=1, cp=2, micro_batches=2, max_tokens=700, cp_sizes=(1, 2))
    rows = doc_rows(360, 4, long_every=9, long_len=1000)
    stream = BalancedStream(rows, topo, balancer.CostModel(1.0, 50.0), window_docs=60)
    monitor = BalanceMonitor(StreamSteps(stream), mode="adapt", warmup_steps=0, min_samples=8, cuda=False)
    for j, mb in enumerate(stream):
        monitor.record(_seconds(mb, stream.pool_rank == 1))  # pool rank 1 twice as slow, in its groups too
        if j % 2 == 1:
            monitor.end_step()
    monitor.flush()
    planned = [stream.model_for(w)[0].rank_speeds for w in range(stream.windows_done)]
    models = [(list(x.start), x.cost.to_dict(), x.speeds) for x in monitor.models]
    sizes = sorted({int(row[8]) for row in monitor.ledger.mb})
    Path(out, f"{rank}.json").write_text(json.dumps({"models": models, "planned": planned, "sizes": sizes,
                                                     "speeds": monitor.report()["rank_speeds"]}))  # fmt: skip


def test_dynamic_cp_stream_measures_groups_and_plans_pool_rank_speeds(tmp_path):
    run_world(2, _dynamic_body, str(tmp_path))
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1]
    assert got[0]["sizes"] == [1, 2]  # groups of one rank and of both
    speeds = got[0]["speeds"]
    assert speeds[1] < 0.75 * speeds[0]
    planned = got[0]["planned"]
    assert planned[0] is None and planned[-1] is not None and len(planned[-1]) == 2 and planned[-1][1] < planned[-1][0]
