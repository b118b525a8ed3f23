"""Helpers for the BalancedStream tests: corpora written as JSONL / Parquet files, the per-rank bodies run in spawned
gloo worlds, and the coverage checks. Token ids encode (document, position): `doc * STRIDE + position`."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np

STRIDE = 100_000


def doc_rows(n: int, seed: int, long_every: int = 0, max_len: int = 300, long_len: int = 1500) -> list[dict]:
    """`n` documents of random lengths (every `long_every`-th one `long_len` tokens), ids encoding (doc, pos)."""
    rng = np.random.default_rng(seed)
    rows = []
    for d in range(n):
        length = long_len if long_every and d % long_every == long_every - 1 else int(rng.integers(1, max_len))
        rows.append({"input_ids": (d * STRIDE + np.arange(length)).tolist(), "doc": d, "tag": f"d{d}"})
    return rows


def write_shards(folder: Path, rows: list[dict], sizes: list[int], kind: str = "jsonl") -> list[str]:
    """The rows cut into files of `sizes` rows (uneven sizes: uneven shard ends); their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    assert sum(sizes) == len(rows)
    paths, at = [], 0
    for i, size in enumerate(sizes):
        part = rows[at : at + size]
        at += size
        path = folder / f"part-{i:03d}.{kind}"
        if kind == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(part), path)
        paths.append(str(path))
    return paths


def open_hf(paths: list[str], kind: str = "jsonl"):
    import datasets

    builder = "json" if kind == "jsonl" else "parquet"
    return datasets.load_dataset(builder, data_files=paths, split="train", streaming=True)


def tokens_of(batches) -> Counter:
    """(doc, position) pairs of every token of the micro-batches (lists of rows)."""
    c: Counter = Counter()
    for mb in batches:
        for row in mb:
            ids = np.asarray(row["input_ids"], dtype=np.int64)
            c.update(zip((ids // STRIDE).tolist(), (ids % STRIDE).tolist()))
    return c


def all_tokens(rows: list[dict]) -> Counter:
    return tokens_of([rows])


def as_lists(batches) -> list:
    """Micro-batches as comparable plain data: per row the token ids and the other columns."""
    return [
        [
            (np.asarray(r["input_ids"]).tolist(), {k: v for k, v in r.items() if k not in ("input_ids", "cp_group")})
            for r in mb
        ]
        for mb in batches
    ]


def make_source(cfg: dict):
    kind = cfg["source"]
    if kind in ("jsonl", "parquet"):
        return open_hf(cfg["paths"], kind)
    if kind == "folder":
        return cfg["folder"]
    if kind == "list":
        return cfg["rows"]
    raise ValueError(kind)


def _stream(cfg: dict):
    import balancer
    from balancer.streaming import BalancedStream

    topo = balancer.Topology(**cfg["topology"])
    cost = balancer.CostModel(*cfg.get("cost", (1.0, 50.0)))
    return BalancedStream(
        make_source(cfg), topo, cost, window_docs=cfg["window_docs"], seed=cfg.get("seed", 0),
        overflow=cfg.get("overflow", "error"),
    )  # fmt: skip


def run_rank(rank: int, world: int, cfg: dict, out: str) -> None:
    """One rank of a stream test: iterate (all of it, up to `stop` micro-batches, or from a saved state), then
    write what it yielded, its state and stats to `out/rank{rank}.pkl`. `loads`: also, for each state file, a new
    stream resumed from it and iterated to the end (`result["resumed"]`)."""
    stream = _stream(cfg)
    if cfg.get("load"):
        stream.load_state_dict(json.loads(Path(cfg["load"]).read_text()))
    resumed = []
    for path in cfg.get("loads", ()):
        again = _stream(cfg)
        again.load_state_dict(json.loads(Path(path).read_text()))
        resumed.append(as_lists(list(again)))
    from balancer import PackedCollator

    coll = PackedCollator()
    got, states, loss = [], {}, []
    stop = cfg.get("stop")
    probe = set(cfg.get("probe", ()))
    it = iter(stream)
    error = None
    try:
        while stop is None or len(got) < stop:
            if len(got) in probe:
                states[len(got)] = json.dumps(stream.state_dict())
            try:
                got.append(next(it))
            except StopIteration:
                break
            loss.append((stream.step_loss_tokens(), coll(got[-1])["num_loss_tokens"]))
    except Exception as e:  # the failing-source test checks the message on every rank
        error = f"{type(e).__name__}: {e}"
    state = json.dumps(stream.state_dict()) if error is None else None
    if cfg.get("save") and rank == 0 and state is not None:
        Path(cfg["save"]).write_text(state)
    result = {
        "batches": as_lists(got),
        "loss": loss,
        "resumed": resumed,
        "state": state,
        "states": states,
        "stats": stream.stats(),
        "error": error,
    }
    result["dp_rank"], result["pool_rank"] = stream.dp_rank, stream.pool_rank
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def read_ranks(out: Path, world: int) -> list[dict]:
    return [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]


def replica_batches(results: list[dict], per: int) -> list[list]:
    """One rank's batches per block of `per` processes (a replica), after checking the block got the same ones."""
    out = []
    for first in range(0, len(results), per):
        block = results[first : first + per]
        for other in block[1:]:
            assert other["batches"] == block[0]["batches"], "processes of one replica got different micro-batches"
        out.append(block[0]["batches"])
    return out


def count_tokens(batch_lists) -> Counter:
    c: Counter = Counter()
    for batches in batch_lists:
        for mb in batches:
            for ids, _ in mb:
                a = np.asarray(ids, dtype=np.int64)
                c.update(zip((a // STRIDE).tolist(), (a % STRIDE).tolist()))
    return c
