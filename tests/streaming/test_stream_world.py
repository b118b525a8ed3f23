"""BalancedStream in real gloo worlds (spawned processes) over real `datasets` streaming objects on local files:
every token exactly once, equal micro-batch counts, CP ranks of a replica getting the same micro-batches, dynamic
CP groups, uneven shard ends, a failing source, exact resume at random points and on 4 -> 2 and 2 -> 4 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from stream_cases import all_tokens, count_tokens, doc_rows, read_ranks, replica_batches, run_rank, write_shards
from support.dist import run_world

pytestmark = pytest.mark.slow


def _world(tmp_path, world: int, cfg: dict, name: str = "out") -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    run_world(world, run_rank, cfg, str(out))
    return read_ranks(out, world)


def _corpus(tmp_path, n=300, sizes=(90, 7, 61, 3, 100, 39), kind="jsonl", seed=0, long_every=23):
    rows = doc_rows(n, seed, long_every=long_every)
    paths = write_shards(tmp_path / "data", rows, list(sizes), kind)
    return rows, paths


def _check_once(results, rows, per: int) -> None:
    counts = {len(r["batches"]) for r in results}
    assert len(counts) == 1, f"unequal micro-batch counts {[len(r['batches']) for r in results]}"
    got = count_tokens(replica_batches(results, per))
    want = all_tokens(rows)
    assert got == want, f"{sum((got - want).values())} extra, {sum((want - got).values())} missing tokens"


def test_static_dp4_jsonl_exactly_once(tmp_path):
    rows, paths = _corpus(tmp_path)
    topo = {"dp": 4, "micro_batches": 2, "max_tokens": 512}
    cfg = {"source": "jsonl", "paths": paths, "topology": topo, "window_docs": 64, "overflow": "split"}
    results = _world(tmp_path, 4, cfg)
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    _check_once(results, rows, 1)
    whole = [(ids, extra) for r in results for mb in r["batches"] for ids, extra in mb if extra["doc"] == 5]
    assert whole and whole[0][1] == {"doc": 5, "tag": "d5"}  # other columns carried through untouched
    states = {r["state"] for r in results}
    assert len(states) == 1  # the same state on every rank, no communication
    assert all(r["stats"]["bytes_sent"] > 0 for r in results)
    m = topo["micro_batches"]  # the global loss tokens of a step: the sum of every rank's collated counts
    for step in range(len(results[0]["loss"]) // m):
        told = {r["loss"][step * m][0] for r in results}
        summed = sum(r["loss"][step * m + j][1] for r in results for j in range(m))
        assert told == {summed}, (step, told, summed)


def test_cp_replicas_same_micro_batches_parquet(tmp_path):
    rows, paths = _corpus(tmp_path, n=200, sizes=(50, 50, 100), kind="parquet")
    topo = {"dp": 2, "cp": 2, "micro_batches": 2, "max_tokens": 256}
    cfg = {"source": "parquet", "paths": paths, "topology": topo, "window_docs": 48, "overflow": "split"}
    results = _world(tmp_path, 4, cfg)
    assert [r["dp_rank"] for r in results] == [0, 0, 1, 1]
    _check_once(results, rows, 2)


def test_dynamic_cp_groups(tmp_path):
    rows, paths = _corpus(tmp_path, n=160, sizes=(40, 40, 40, 40), long_every=11)
    topo = {"dp": 2, "cp": 2, "micro_batches": 2, "max_tokens": 512, "cp_sizes": (1, 2, 4)}
    cfg = {"source": "jsonl", "paths": paths, "topology": topo, "window_docs": 40, "overflow": "split"}
    results = _world(tmp_path, 4, cfg)
    assert len({len(r["batches"]) for r in results}) == 1
    # a micro-batch of a group of size g reaches its g members: count each token once per member, divide by g
    got = count_tokens([r["batches"] for r in results])
    sizes = {}
    for r in results:
        for mb in r["batches"]:
            for ids, _ in mb:
                sizes.setdefault(ids[0], set()).add(r["pool_rank"])
    want = all_tokens(rows)
    assert set(got) == set(want)
    first_tokens = {(i // 100_000, i % 100_000): len(s) for i, s in sizes.items()}
    for key, n in got.items():
        assert n == first_tokens.get(key, n)  # every piece's tokens reach exactly its group's members


def test_uneven_ends_one_rank_runs_out_early(tmp_path):
    # 4 files for 4 ranks: rank 3's file holds 5 documents, the others 100
    rows, paths = _corpus(tmp_path, n=305, sizes=(100, 100, 100, 5), long_every=0)
    topo = {"dp": 4, "micro_batches": 1, "max_tokens": 1024}
    cfg = {"source": "jsonl", "paths": paths, "topology": topo, "window_docs": 40}
    results = _world(tmp_path, 4, cfg)
    _check_once(results, rows, 1)


def test_plain_iterable_every_world_th_item(tmp_path):
    rows = doc_rows(150, 3)
    topo = {"dp": 3, "micro_batches": 2, "max_tokens": 1024}
    cfg = {"source": "list", "rows": rows, "topology": topo, "window_docs": 30}
    results = _world(tmp_path, 3, cfg)
    _check_once(results, rows, 1)


class FailingRows:
    """A re-iterable source whose iteration fails on global rank 1 after 40 items."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        import torch.distributed as dist

        for i, row in enumerate(self.rows):
            if dist.get_rank() == 1 and i == 40:
                raise OSError("disk gone (test)")
            yield row


def _failing_rank(rank, world, out):
    import pickle
    from pathlib import Path

    import balancer
    from balancer.streaming import BalancedStream

    stream = BalancedStream(
        FailingRows(doc_rows(200, 1)), balancer.Topology(dp=world, max_tokens=1024), balancer.CostModel(1.0, 1.0),
        window_docs=16,
    )  # fmt: skip
    try:
        n = sum(1 for _ in stream)
        msg = f"no error after {n}"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(msg))


def test_failing_source_raises_on_every_rank(tmp_path):
    import pickle

    run_world(3, _failing_rank, str(tmp_path))
    msgs = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(3)]
    for m in msgs:
        assert m.startswith("StreamSourceError: the stream's source failed on rank 1"), m
        assert "OSError: disk gone (test)" in m


def test_resume_at_random_points(tmp_path):
    rows, paths = _corpus(tmp_path, n=200, sizes=(60, 40, 70, 30))
    topo = {"dp": 2, "micro_batches": 2, "max_tokens": 512}
    base = {"source": "jsonl", "paths": paths, "topology": topo, "window_docs": 40, "overflow": "split"}
    rng = np.random.default_rng(7)
    points = sorted(int(p) for p in rng.choice(np.arange(1, 40), size=5, replace=False))
    full = _world(tmp_path, 2, {**base, "probe": points}, "full")  # states taken along an uninterrupted run
    n = len(full[0]["batches"])
    assert n > max(points)
    files = []
    for p in points:
        assert full[0]["states"][p] == full[1]["states"][p]  # every rank: the same state at the same micro-batch
        files.append(str(tmp_path / f"s{p}.json"))
        Path(files[-1]).write_text(full[0]["states"][p])
    again = _world(tmp_path, 2, {**base, "stop": 0, "loads": files}, "again")
    for r in range(2):
        for p, rest in zip(points, again[r]["resumed"]):
            assert full[r]["batches"][:p] + rest == full[r]["batches"], f"resume at {p}, rank {r}"
    _check_once(full, rows, 1)


@pytest.mark.parametrize("worlds", [(4, 2), (2, 4)])
def test_resume_on_another_dp_size(tmp_path, worlds):
    a, b = worlds
    rows, paths = _corpus(tmp_path, n=260, sizes=(70, 30, 90, 20, 50))
    base = {"source": "jsonl", "paths": paths, "window_docs": 48, "overflow": "split"}
    state = tmp_path / "state.json"
    first = _world(tmp_path, a, {**base, "topology": {"dp": a, "micro_batches": 2, "max_tokens": 512},
                                 "stop": 2 * 5, "save": str(state)}, "a")  # fmt: skip
    assert json.loads(state.read_text())["position"] % 2 == 0
    rest = _world(tmp_path, b, {**base, "topology": {"dp": b, "micro_batches": 2, "max_tokens": 512},
                                "load": str(state)}, "b")  # fmt: skip
    assert len({len(r["batches"]) for r in rest}) == 1
    got = count_tokens([r["batches"] for r in first] + [r["batches"] for r in rest])
    assert got == all_tokens(rows)
