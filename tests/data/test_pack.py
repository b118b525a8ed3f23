"""balancer pack: packed rows from a real pretokenized folder (real Arrow files via `datasets`), checked against the
source tokens and the plans; the transformers padding-free collator and a tiny real model on the rows; SIGKILL and
resume with real subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from support.data_files import dir_bytes, kill_at_progress, make_texts, write_jsonl  # noqa: E402

import balancer  # noqa: E402
from balancer.cli import main as cli_main  # noqa: E402
from balancer.data.pack.build import pack
from balancer.data.pack.rows import PackError  # noqa: E402
from balancer.data.pack.verify import packed_metrics, verify_packed
from balancer.data.pretokenize.options import PretokenizeOptions
from balancer.data.pretokenize.pipeline import pretokenize
from balancer.data.shards.dataset import ShardDataset
from balancer.data.shards.errors import DataError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOPO = balancer.Topology(dp=2, cp=2, micro_batches=3, max_tokens=1024)
COST = balancer.CostModel(attn_coef=2 / 3000, linear_coef=1.0)
EPOCHS, SEED = 2, 5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A pretokenized folder in 5+ shards; rows of up to 3000 tokens (longer documents were split in windows),
    so some rows are longer than a micro-batch (2048) and the plans split them again."""
    d = tmp_path_factory.mktemp("src")
    write_jsonl(d / "a.jsonl", make_texts(300, seed=1))
    opts = PretokenizeOptions(max_length=3000, shard_tokens=60_000)
    pretokenize([str(d / "a.jsonl")], d / "tok", options=opts, progress=False)
    return d / "tok"


@pytest.fixture(scope="module")
def packed(tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "out"
    manifest = pack(tok, out, TOPO, COST, epochs=EPOCHS, seed=SEED, overflow="split", shard_tokens=40_000)
    return out, manifest


def columns(folder: Path) -> dict:
    """Every column of a packed folder read through `datasets.load_from_disk`: list columns as (offsets, values)."""
    table = datasets.load_from_disk(str(folder)).data.table.combine_chunks()
    cols = {}
    for name in table.column_names:
        col = table.column(name).chunk(0)
        if hasattr(col, "offsets"):
            cols[name] = (col.offsets.to_numpy().astype(np.int64), col.values.to_numpy())
        else:
            cols[name] = col.to_numpy()
    return cols


def row(cols: dict, name: str, i: int) -> np.ndarray:
    offsets, values = cols[name]
    return values[offsets[i] : offsets[i + 1]]


def test_every_token_once_per_epoch_in_order_and_as_planned(tok, packed):
    out, manifest = packed
    src = ShardDataset(tok)
    cols = columns(out)
    assert manifest["counts"]["rows"] == len(cols["epoch"])
    pieces_split = 0
    for epoch in range(EPOCHS):
        seen = {d: np.zeros(int(n), dtype=np.int64) for d, n in enumerate(src.lengths)}
        planned = balancer.plan(src.lengths, TOPO, COST, seed=SEED + epoch, overflow="split")
        for i in np.flatnonzero(cols["epoch"] == epoch):
            ids, lens = row(cols, "input_ids", i), row(cols, "seq_lens", i)
            docs, starts = row(cols, "doc_ids", i), row(cols, "doc_starts", i)
            assert lens.sum() == len(ids)
            assert np.array_equal(row(cols, "position_ids", i), np.concatenate([np.arange(n) for n in lens]))
            for piece, d, a, n in zip(np.split(ids, np.cumsum(lens)[:-1]), docs, starts, lens):
                assert np.array_equal(piece, src.token_ids(int(d))[a : a + n])  # in order, the document's own
                seen[int(d)][a : a + n] += 1
                pieces_split += n < src.lengths[d]
            mb = planned.step(int(cols["step"][i])).replicas[int(cols["dp_rank"][i])]
            mb = mb.micro_batches[int(cols["micro_batch"][i])]
            assert docs.tolist() == mb.ids  # epoch e is planned with seed S+e
        assert all((c == 1).all() for c in seen.values()), f"epoch {epoch}: a token missing or repeated"
        saved = balancer.Plan.load(out / f"plan-epoch-{epoch:05d}.json")
        assert np.array_equal(saved.doc, planned.doc) and np.array_equal(saved.start, planned.start)
    assert pieces_split > 0  # the plans did split documents over micro-batches
    assert verify_packed(out) == []


def test_caps_equal_rows_per_rank_and_distributed_sampler(packed):
    out, _ = packed
    cols = columns(out)
    ds = datasets.load_from_disk(str(out))
    tokens = np.diff(cols["input_ids"][0])
    assert tokens.min() > 0 and tokens.max() <= TOPO.max_tokens * TOPO.cp
    n = len(ds)
    assert n % TOPO.dp == 0 and np.array_equal(cols["dp_rank"], np.arange(n) % TOPO.dp)
    keys = np.stack([cols["epoch"], cols["step"], cols["micro_batch"], cols["dp_rank"]], axis=1)
    assert np.array_equal(np.lexsort(keys.T[::-1]), np.arange(n))  # ordered (epoch, step, micro-batch, DP rank)
    for r in range(TOPO.dp):
        got = list(torch.utils.data.DistributedSampler(ds, num_replicas=TOPO.dp, rank=r, shuffle=False))
        assert len(got) == n // TOPO.dp
        assert (cols["dp_rank"][got] == r).all()
        for epoch in range(EPOCHS):
            plan = balancer.Plan.load(out / f"plan-epoch-{epoch:05d}.json")
            mine = [i for i in got if cols["epoch"][i] == epoch]
            want = [m.ids for s in plan.steps for m in s.replicas[r].micro_batches]
            assert [row(cols, "doc_ids", i).tolist() for i in mine] == want


def test_balance_of_rows_equals_plan(packed):
    out, manifest = packed
    from_rows = packed_metrics(out)
    assert len(from_rows) == EPOCHS
    for epoch, got in enumerate(from_rows):
        want = balancer.Plan.load(out / f"plan-epoch-{epoch:05d}.json").metrics()
        assert want == pytest.approx(manifest["epochs"][epoch]["metrics"], rel=1e-12)
        for key in ("steps", "padding_tokens", "dropped_tokens"):
            assert got[key] == want[key]
        for key in ("imbalance", "worst_step", "epoch_efficiency", "token_utilization", "step_time_total"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), key
        assert got["imbalance"] > 1.0  # a real, not a trivially perfect, balance is compared


def unpack(example: dict) -> list[dict]:
    """A packed row -> one feature per piece, for DataCollatorWithFlattening (the docs' example)."""
    cuts = np.cumsum(example["seq_lens"])[:-1]
    return [{"input_ids": ids} for ids in np.split(np.asarray(example["input_ids"]), cuts)]


@pytest.mark.slow  # ~16 s
def test_flattening_collator_and_varlen_on_rows(packed):
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    out, _ = packed
    ds = datasets.load_from_disk(str(out))
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=lambda ex: collate(unpack(ex)))
    multi = 0
    for i, batch in zip(range(12), loader):
        ex = ds[i]
        cu = torch.nn.functional.pad(torch.tensor(ex["seq_lens"]).cumsum(0), (1, 0)).to(torch.int32)
        assert batch["input_ids"][0].tolist() == list(map(int, ex["input_ids"]))
        assert batch["position_ids"][0].tolist() == ex["position_ids"]
        assert torch.equal(batch["cu_seq_lens_q"], cu) and batch["max_length_q"] == max(ex["seq_lens"])
        multi += len(ex["seq_lens"]) > 1
        # the CP path: every CP rank of the replica collates the same row and keeps its share
        shares = [balancer.PackedCollator(cp_rank=c, cp_size=TOPO.cp)(unpack(ex)) for c in range(TOPO.cp)]
        assert torch.equal(shares[0]["cu_seqlens"], cu)
        assert torch.equal(shares[0]["layout"].unshard([s["input_ids"][0] for s in shares]), batch["input_ids"][0])
    assert multi > 0
    # a real (tiny) model: the packed row gives each piece exactly its own logits
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    i = next(i for i in range(len(ds)) if 3 <= len(ds[i]["seq_lens"]) and sum(ds[i]["seq_lens"]) <= 2048)
    batch = collate(unpack(ds[i]))
    with torch.no_grad():
        packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=torch.as_tensor(f["input_ids"])[None]).logits[0] for f in unpack(ds[i])])
    assert (packed_logits - alone).abs().max() <= 2e-5 * alone.abs().max()


def test_bad_input_one_line_exit_2(tok, tmp_path, capsys):
    base = ["pack", "--output", str(tmp_path / "o"), "--dp", "2", "--micro-batches", "2"]
    assert cli_main([*base[:1], str(tmp_path), *base[1:]]) == 2  # not a pretokenize output
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no manifest.json" in err and "balancer pretokenize" in err
    assert cli_main([base[0], str(tok), *base[1:], "--max-tokens", "512"]) == 2  # rows up to 3000 tokens
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--overflow split" in err, err
    row_no = int(re.search(r"row (\d+) \(source record \d+\) has (\d+) tokens", err).group(1))
    assert ShardDataset(tok).lengths[row_no] > 512
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")  # refused before writing anything
    assert cli_main([base[0], str(tok), "--output", str(tmp_path / "o"), "--dp", "4096", "--micro-batches", "8"]) == 2
    err = capsys.readouterr().err.strip()  # the planner refuses: too few rows for one micro-batch on each replica
    assert err.count("\n") == 0 and "lower --dp or --micro-batches (--dp to at most" in err, err
    assert not (tmp_path / "o").exists()  # the folder it created is removed again

    with pytest.raises(PackError, match="cp_sizes=.*dynamic CP"):
        pack(
            tok, tmp_path / "d", balancer.Topology(dp=1, cp=2, micro_batches=2, max_tokens=4096, cp_sizes=(1, 2)), COST
        )
    assert cli_main([base[0], str(tok), *base[1:], "--cp", "2", "--cp-sizes", "1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "dynamic CP" in err and "--cp-sizes" in err, err
    assert not (tmp_path / "d").exists()


def test_verify_catches_corruption_and_rerun_is_idempotent(packed, tmp_path, capsys):
    out, manifest = packed
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in dir_bytes(out).items():
        (copy / name).write_bytes(data)
    assert cli_main(["verify", str(copy)]) == 0
    assert "packed rows" in capsys.readouterr().out
    shard = copy / "shard-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert cli_main(["verify", str(copy)]) == 1
    assert "shard-00001.arrow: sha256 mismatch" in capsys.readouterr().err
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = pack(
        manifest["source"]["path"], out, TOPO, COST, epochs=EPOCHS, seed=SEED, overflow="split", shard_tokens=40_000
    )
    assert again == json.loads((out / "manifest.json").read_text())
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # complete: nothing rewritten
    with pytest.raises(DataError, match="different job"):
        pack(manifest["source"]["path"], out, TOPO, COST, epochs=1, overflow="split")


@pytest.mark.slow
def test_kill9_and_resume_byte_identical(tmp_path):
    """SIGKILL a real `balancer pack` process at random moments, rerun the same command each time: the final folder
    equals an uninterrupted run's byte for byte."""
    write_jsonl(tmp_path / "c.jsonl", make_texts(3000, seed=7, max_words=500))
    pretokenize([str(tmp_path / "c.jsonl")], tmp_path / "tok", progress=False)
    args = ["pack", str(tmp_path / "tok"), "--dp", "2", "--micro-batches", "2", "--max-tokens", "4096"]
    args += ["--overflow", "split", "--epochs", "2", "--shard-tokens", "40000", "-q", "--output"]
    ref = tmp_path / "ref"
    assert cli_main([*args, str(ref)]) == 0
    n_shards = len(json.loads((ref / "manifest.json").read_text())["shards"])
    assert n_shards >= 20
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "balancer", *args, str(out)]
    logs = kill_at_progress(cmd, out, ".pack-state.json", ref, stretches=3, seed=1234)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    logs.append(done.stderr)
    resumed = [int(x) for log in logs for x in re.findall(r"resuming after (\d+) finished shard", log)]
    assert any(0 < k < n_shards for k in resumed), logs  # some kill landed between shards of the writing phase
    assert dir_bytes(out) == dir_bytes(ref)
    assert verify_packed(out) == []


def test_output_folder_ownership(tok, tmp_path):
    """Another job's folder or the user's files are refused; --overwrite deletes only files this tool wrote."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    args = dict(overflow="split", shard_tokens=200_000)
    with pytest.raises(DataError, match="not empty and holds no pack job"):
        pack(tok, mine, TOPO, COST, **args)
    first = pack(tok, mine, TOPO, COST, overwrite=True, **args)
    assert (mine / "notes.txt").read_text() == "the user's" and verify_packed(mine) == []
    with pytest.raises(DataError, match="different job"):
        pack(tok, mine, TOPO, COST, seed=1, **args)
    second = pack(tok, mine, TOPO, COST, seed=1, overwrite=True, **args)
    assert second["job"] != first["job"] and verify_packed(mine) == []
    assert (mine / "notes.txt").exists()
    from balancer.data.shards.output import OutputLock

    with OutputLock(mine):  # another run writing the folder
        with pytest.raises(DataError, match="being written by another run"):
            pack(tok, mine, TOPO, COST, seed=2, overwrite=True, **args)
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "shard-00000.arrow").write_bytes(b"not ours")
    with pytest.raises(DataError, match="not provably this tool"):
        pack(tok, clash, TOPO, COST, overwrite=True, **args)
    assert (clash / "shard-00000.arrow").read_bytes() == b"not ours"
    # a user's file with a plan name beside a finished job of ours: neither --overwrite nor a rerun replaces it
    (mine / "plan-epoch-00003.json").write_text("my plan")
    for overwrite in (False, True):
        with pytest.raises(DataError, match="plan-epoch-00003.json: has a name this tool writes"):
            pack(tok, mine, TOPO, COST, seed=3, overwrite=overwrite, **args)
    assert (mine / "plan-epoch-00003.json").read_text() == "my plan"


def test_truncate_keeps_each_row_head_and_counts_the_rest(tok, tmp_path):
    src = ShardDataset(tok)
    cap = TOPO.max_tokens * TOPO.cp
    m = pack(tok, tmp_path / "t", TOPO, COST, overflow="truncate")
    dropped = int(np.maximum(src.lengths - cap, 0).sum())
    assert dropped > 0 and m["counts"]["dropped_tokens"] == dropped
    assert packed_metrics(tmp_path / "t")[0]["dropped_tokens"] == dropped
    cols = columns(tmp_path / "t")
    assert (cols["doc_starts"][1] == 0).all() and sorted(cols["doc_ids"][1].tolist()) == list(range(len(src)))
    for i in range(len(cols["epoch"])):
        for piece, d, n in zip(
            np.split(row(cols, "input_ids", i), np.cumsum(row(cols, "seq_lens", i))[:-1]),
            row(cols, "doc_ids", i),
            row(cols, "seq_lens", i),
        ):
            assert n == min(src.lengths[d], cap) and np.array_equal(piece, src.token_ids(int(d))[:n])


def test_epochs_whose_output_cannot_fit_the_free_disk_are_refused_naming_the_flag(tok, tmp_path, capsys):
    """On a real 1 MiB tmpfs (root only; skipped otherwise): `--epochs` whose rows cannot fit is refused before
    anything is planned or written, one line naming --epochs and the free space; one epoch that fits runs (before,
    the run planned and wrote until the disk was full)."""
    tokens = int(np.asarray(ShardDataset(tok).lengths).sum())
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = 3 * tokens * 6  # room for about three epochs of uint16 ids + int32 positions (and the metadata)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        args = ["pack", str(tok), "--output", str(mnt / "out"), "--dp", "2", "--micro-batches", "2"]
        assert cli_main([*args, "--max-tokens", "4096", "--epochs", "40"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--epochs 40: the packed rows need at least" in err[0] and "free on" in err[0], err
        assert os.listdir(mnt) == []  # refused before the output folder was made
        with pytest.raises(PackError, match=r"epochs 40: the packed rows need at least"):
            pack(tok, mnt / "out", TOPO, COST, epochs=40, overflow="split")
        assert cli_main([*args, "--max-tokens", "4096", "--epochs", "1"]) == 0
        assert verify_packed(mnt / "out") == []
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
