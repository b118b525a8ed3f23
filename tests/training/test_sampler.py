"""BalancedBatchSampler, PackedCollator and balancer.loss: coverage, determinism, resume (same and elastic
topology), real DataLoaders over a real `datasets` Arrow dataset and a pretokenized folder, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.coverage import covered_tokens

from attention.layout import CPLayout  # noqa: E402
from balancer.planning.cost.model import CostModel  # noqa: E402
from balancer.planning.topology import Topology  # noqa: E402
from balancer.training.collate import PackedCollator  # noqa: E402
from balancer.training.indices import Span, SpanDataset
from balancer.training.loss import token_loss  # noqa: E402
from balancer.training.sampler import BalancedBatchSampler  # noqa: E402

COST = CostModel(attn_coef=1.0, linear_coef=50.0)
TOPO = Topology(dp=4, cp=2, micro_batches=2, max_tokens=256, tokens_per_step=2800)


def _lengths(n=300, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 120, n)
    x[rng.choice(n, 12, replace=False)] = rng.integers(200, 512, 12)  # a heavy tail
    return x


LENGTHS = _lengths()


def _samplers(topo=TOPO, lengths=LENGTHS, seed=0, **kw):
    return [BalancedBatchSampler(lengths, topo, COST, dp_rank=r, seed=seed, **kw) for r in range(topo.dp)]


def _key(i):
    return (i.doc, i.start, i.end) if isinstance(i, Span) else (int(i), 0, None)


# ---------------------------------------------------------------------------------------------------- epochs
def test_three_epochs_four_ranks_coverage_counts_determinism():
    samplers = _samplers()
    again = _samplers()
    epochs = []
    for e in range(3):
        per_rank = []
        for s, s2 in zip(samplers, again):
            s.set_epoch(e)
            s2.set_epoch(e)
            mbs = list(s)
            assert mbs == list(s2), "not deterministic"
            assert len(mbs) == len(s) and len(mbs) % TOPO.micro_batches == 0
            assert all(len(mb) > 0 for mb in mbs)
            assert all(isinstance(i, int) for mb in mbs for i in mb)
            per_rank.append(mbs)
        assert len({len(x) for x in per_rank}) == 1, "ranks disagree on the micro-batch count"
        flat = sorted(i for mbs in per_rank for mb in mbs for i in mb)
        assert flat == list(range(len(LENGTHS))), "every document exactly once per epoch"
        for mbs in per_rank:  # the caps hold
            for mb in mbs:
                assert LENGTHS[mb].sum() <= TOPO.micro_batch_tokens
        epochs.append(per_rank)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != epochs[2], "epochs should differ"
    # a fresh sampler with a different seed plans differently
    other = _samplers(seed=1)[0]
    assert list(other) != epochs[0][0]


def test_step_loss_tokens_and_telemetry():
    samplers = _samplers()
    s0 = samplers[0]
    for step in range(s0.num_steps):
        docs = [i for s in samplers for m in range(TOPO.micro_batches) for i in s.micro_batch(step, m)]
        assert s0.step_loss_tokens(step) == int((LENGTHS[docs] - 1).sum())
        assert s0.step_tokens(step) == int(LENGTHS[docs].sum())
        assert s0.step_num_sequences(step) == int((LENGTHS[docs] > 1).sum())
        info = s0.predicted_step(step)
        assert info["replica_times"].shape == (TOPO.dp,)
        assert info["imbalance"] >= 1.0 - 1e-9
        # every rank agrees on the step's numbers (no communication)
        assert all(s.step_loss_tokens(step) == s0.step_loss_tokens(step) for s in samplers)
    with pytest.raises(IndexError):
        s0.step_loss_tokens(s0.num_steps)


# ---------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("epoch", [0, 2])
def test_resume_same_topology_every_boundary_and_mid_step(epoch):
    s = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=0)
    s.set_epoch(epoch)
    full = list(s)
    for cut in range(len(full) + 1):  # every micro-batch: step boundaries and mid-step
        a = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=0)
        a.set_epoch(epoch)
        it = iter(a)
        head = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(a.state_dict()))  # survives JSON
        b = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=0)
        b.load_state_dict(state)
        b.set_epoch(epoch)  # the usual loop calls set_epoch again: keeps the position
        assert head + list(b) == full, cut
        assert list(b) == full  # the next pass is the whole epoch again


def test_stateful_iterator_protocol():
    """torchdata's StatefulDataLoader saves/restores the batch sampler's iterator through state_dict/
    load_state_dict on the object iter() returned."""
    s = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=2, seed=4)
    full = list(s)
    it = iter(s)
    for _ in range(3):
        next(it)
    sd = it.state_dict()
    s2 = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=2, seed=4)
    it2 = iter(s2)
    it2.load_state_dict(sd)
    assert list(it2) == full[3:]


@pytest.mark.slow  # ~4 s per case
@pytest.mark.parametrize(
    "overflow,lengths", [("error", LENGTHS), ("split", np.concatenate([LENGTHS, [900, 1500, 700]]))]
)
def test_elastic_resume_4_to_2_to_3_ranks(overflow, lengths):
    """Resume at every step boundary of a dp=4 epoch onto dp=2 (and then onto dp=3 with a different cp):
    every token of the epoch exactly once, no micro-batch lost or repeated, equal counts on the new ranks."""
    topo4 = TOPO
    topo2 = Topology(dp=2, cp=2, micro_batches=3, max_tokens=256, tokens_per_step=2800)
    topo3 = Topology(dp=3, cp=1, micro_batches=2, max_tokens=512, tokens_per_step=2000)
    old = _samplers(topo4, lengths, seed=0, overflow=overflow)
    for s in old:
        s.set_epoch(1)
    full = [list(s) for s in old]
    want = covered_tokens([i for mbs in full for mb in mbs for i in mb], lengths)
    assert set(want.values()) == {1}
    M = topo4.micro_batches
    n_steps = old[0].num_steps
    for k in sorted({0, 1, n_steps // 2, n_steps - 1, n_steps}):
        consumed = [i for mbs in full for mb in mbs[: k * M] for i in mb]
        for s in old:  # each rank's state at step boundary k
            s.load_state_dict(s.state_dict(position=k * M))
        state = old[0].state_dict()
        assert all(o.state_dict()["segments"] == state["segments"] for o in old)
        new = _samplers(topo2, lengths, seed=0, overflow=overflow)
        for s in new:
            s.load_state_dict(state)
        rest = [list(s) for s in new]
        assert len({len(r) for r in rest}) == 1
        got = covered_tokens(consumed + [i for mbs in rest for mb in mbs for i in mb], lengths)
        assert got == want, f"step {k}: tokens lost or repeated"
        if k == n_steps // 2 and len(rest[0]) >= topo2.micro_batches:
            # chain: after one step on dp=2, move on to dp=3 / cp=1
            for s in new:
                s.load_state_dict(s.state_dict(position=topo2.micro_batches))  # a hand-edited state is refused
            consumed2 = consumed + [i for mbs in rest for mb in mbs[: topo2.micro_batches] for i in mb]
            newer = _samplers(topo3, lengths, seed=0, overflow=overflow)
            for s in newer:
                s.load_state_dict(new[0].state_dict())
            rest3 = [list(s) for s in newer]
            assert len({len(r) for r in rest3}) == 1
            assert covered_tokens(consumed2 + [i for mbs in rest3 for mb in mbs for i in mb], lengths) == want
    # mid-step onto another topology is refused
    old[0].load_state_dict(old[0].state_dict(position=1))
    with pytest.raises(ValueError, match="mid-step"):
        _samplers(topo2, lengths, overflow=overflow)[0].load_state_dict(old[0].state_dict())


# ---------------------------------------------------------------------------------------------------- DataLoader
def _check_loader(dataset, lengths, topo, cp_rank=0):
    samplers = [BalancedBatchSampler(lengths, topo, COST, dp_rank=r, seed=0, dataset=dataset) for r in range(topo.dp)]
    seen = []
    for s in samplers:
        coll = PackedCollator(cp_rank=cp_rank, cp_size=topo.cp)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=s, collate_fn=coll)
        n = 0
        for i, batch in enumerate(loader):
            step, m = s.step_of(i)
            docs = s.micro_batch(step, m)
            seen += docs
            assert batch["num_tokens"] == int(np.asarray(lengths)[docs].sum())
            assert batch["input_ids"].shape == (1, batch["layout"].num_local_tokens(cp_rank))
            assert batch["cu_seqlens"].dtype == torch.int32
            n += 1
        assert n == len(s)
    assert sorted(seen) == list(range(len(lengths)))


def test_dataloader_over_arrow_dataset():
    import datasets

    rng = np.random.default_rng(0)
    lens = rng.integers(1, 60, 80)
    ds = datasets.Dataset.from_dict({"input_ids": [rng.integers(0, 100, n).tolist() for n in lens]})
    ds = ds.with_format("torch")
    topo = Topology(dp=2, cp=2, micro_batches=2, max_tokens=64, tokens_per_step=400)
    _check_loader(ds, lens, topo, cp_rank=1)
    # lengths taken from the dataset itself, or from a column of it
    s = BalancedBatchSampler(ds, topo, COST, dp_rank=0)
    assert np.array_equal(s.lengths, lens)
    ds2 = ds.add_column("n", lens.tolist())
    assert np.array_equal(BalancedBatchSampler("n", topo, COST, dp_rank=0, dataset=ds2).lengths, lens)
    assert np.array_equal(BalancedBatchSampler("input_ids", topo, COST, dp_rank=0, dataset=ds2).lengths, lens)
    with pytest.raises(ValueError, match="do not match the dataset"):
        BalancedBatchSampler(lens[:-1], topo, COST, dp_rank=0, dataset=ds)


def test_dataloader_over_pretokenized_folder(tmp_path):
    from balancer.data.pretokenize.options import PretokenizeOptions
    from balancer.data.pretokenize.pipeline import pretokenize
    from balancer.data.shards.dataset import ShardDataset

    rng = np.random.default_rng(1)
    with open(tmp_path / "c.jsonl", "w") as f:
        for _ in range(60):
            f.write(json.dumps({"text": "x" * int(rng.integers(1, 90))}) + "\n")
    out = tmp_path / "tok"
    pretokenize([str(tmp_path / "c.jsonl")], out, options=PretokenizeOptions(), progress=False)
    ds = ShardDataset(out)
    topo = Topology(dp=2, cp=2, micro_batches=2, max_tokens=64, tokens_per_step=400)
    _check_loader(ds, ds.lengths, topo)
    s_path = BalancedBatchSampler(str(out), topo, COST, dp_rank=1, dataset=ds)
    s_ds = BalancedBatchSampler(ds, topo, COST, dp_rank=1)
    assert list(s_path) == list(s_ds)


def test_split_documents_through_span_dataset():
    lens = np.array([10, 300, 20, 5, 7, 33, 12, 9])
    data = [{"input_ids": torch.arange(n) % 50} for n in lens]
    topo = Topology(dp=2, cp=1, micro_batches=2, max_tokens=100, tokens_per_step=380)
    s = BalancedBatchSampler(lens, topo, COST, dp_rank=0, overflow="split")
    spans = [i for mb in s for i in mb if isinstance(i, Span)]
    assert spans and all(sp.doc == 1 for sp in spans)
    with pytest.raises(TypeError, match="SpanDataset"):
        data[spans[0]]
    loader = torch.utils.data.DataLoader(SpanDataset(data), batch_sampler=s, collate_fn=PackedCollator())
    for batch in loader:
        assert batch["num_tokens"] <= topo.micro_batch_tokens


# ---------------------------------------------------------------------------------------------------- bad input
def test_bad_input():
    with pytest.raises(ValueError, match="document 2 has no tokens"):
        BalancedBatchSampler([3, 4, 0, 5], Topology(dp=1), COST, dp_rank=0)
    with pytest.raises(ValueError, match="more than a micro-batch holds"):
        BalancedBatchSampler([3, 4, 500, 5], Topology(dp=1, max_tokens=100), COST, dp_rank=0)
    BalancedBatchSampler([3, 4, 500, 5], Topology(dp=1, max_tokens=100), COST, dp_rank=0, overflow="truncate")
    with pytest.raises(ValueError, match="out of range"):
        BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=4)
    with pytest.raises(ValueError, match="dp_rank is not given"):
        BalancedBatchSampler(LENGTHS, TOPO, COST)
    s = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, seed=1).load_state_dict(s.state_dict())
    other = LENGTHS.copy()
    other[0] += 1
    with pytest.raises(ValueError, match="another data set"):
        BalancedBatchSampler(other, TOPO, COST, dp_rank=0).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="out of range"):
        s.state_dict(position=len(s) + 1)
    with pytest.raises(ValueError, match="not a BalancedBatchSampler state"):
        s.load_state_dict({"position": 3})
    coll = PackedCollator(cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="item 1 .*no 'input_ids'"):
        coll([{"input_ids": [1, 2]}, {"text": "x"}])
    with pytest.raises(ValueError, match="item 0 .*empty"):
        coll([{"input_ids": []}])
    with pytest.raises(ValueError, match="cp_rank"):
        PackedCollator(cp_rank=2, cp_size=2)


# ---------------------------------------------------------------------------------------------------- collator
@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    cp=st.integers(1, 4),
    kind=st.sampled_from(["zigzag", "contiguous"]),
    pad=st.sampled_from([None, 1, 8]),
    with_labels=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_collator_unshard_roundtrip(lens, cp, kind, pad, with_labels, seed):
    g = torch.Generator().manual_seed(seed)
    items = []
    for n in lens:
        it = {"input_ids": torch.randint(0, 1000, (n,), generator=g)}
        if with_labels:
            lab = it["input_ids"].clone()
            lab[torch.rand(n, generator=g) < 0.3] = -100
            it["labels"] = lab.tolist()
        items.append(it)
    outs = [PackedCollator(cp_rank=r, cp_size=cp, layout=kind, pad_to_multiple_of=pad)(items) for r in range(cp)]
    layout = outs[0]["layout"]
    assert isinstance(layout, CPLayout) and layout.kind == kind and layout.cp_size == cp
    ids = torch.cat([it["input_ids"] for it in items])
    n_real = len(ids)
    T = layout.num_tokens
    assert T % (pad or 1) == 0 and T - n_real == outs[0]["num_pad_tokens"] < (pad or 1)
    full = {k: layout.unshard([o[k][0] for o in outs]) for k in ("input_ids", "labels", "position_ids", "seq_ids")}
    assert torch.equal(full["input_ids"][:n_real], ids)
    want_lab, want_pos = [], []
    for it in items:
        src = torch.as_tensor(it.get("labels", it["input_ids"]))
        lab = torch.full_like(it["input_ids"], -100)
        lab[:-1] = src[1:]
        want_lab.append(lab)
        want_pos.append(torch.arange(len(lab)))
    assert torch.equal(full["labels"][:n_real], torch.cat(want_lab))
    assert torch.equal(full["position_ids"][:n_real], torch.cat(want_pos))
    assert (full["labels"][n_real:] == -100).all() and (full["seq_ids"][n_real:] == -1).all()
    assert torch.equal(full["position_ids"][n_real:], torch.arange(T - n_real))
    assert outs[0]["num_tokens"] == n_real
    assert outs[0]["num_loss_tokens"] == int((torch.cat(want_lab) != -100).sum())
    assert sum(int((o["labels"] != -100).sum()) for o in outs) == outs[0]["num_loss_tokens"]
    assert outs[0]["cu_seqlens"].tolist()[-1] == T and outs[0]["max_seqlen"] == max(lens + [T - n_real])


# ---------------------------------------------------------------------------------------------------- loss
def test_loss_global_and_sequence_normalisation():
    torch.manual_seed(0)
    lens = [5, 1, 9, 3, 12]
    items = [{"input_ids": torch.randint(0, 11, (n,))} for n in lens]
    logits_full = torch.randn(sum(lens), 11, dtype=torch.float64, requires_grad=True)
    # reference: per document CE
    ce, off = [], 0
    for it in items:
        n = len(it["input_ids"])
        if n > 1:
            ce.append(
                torch.nn.functional.cross_entropy(logits_full[off : off + n - 1], it["input_ids"][1:], reduction="none")
            )
        off += n
    mean_token = torch.cat(ce).mean()
    mean_seq = torch.stack([c.mean() for c in ce]).mean()
    # split into 2 "micro-batches" x 2 CP ranks, summed
    for reduction, want in (("global", mean_token), ("sequence", mean_seq)):
        total = 0.0
        for part, off0 in ((items[:2], 0), (items[2:], sum(lens[:2]))):
            outs = [PackedCollator(cp_rank=r, cp_size=2)(part) for r in range(2)]
            n = sum(len(i["input_ids"]) for i in part)
            for r, o in enumerate(outs):
                lg = o["layout"].shard(logits_full[off0 : off0 + n], r)[None]
                total = total + token_loss(
                    lg,
                    o["labels"],
                    sum(lens) - len(lens),
                    reduction=reduction,
                    seq_ids=o["seq_ids"],
                    seq_loss_tokens=o["seq_loss_tokens"],
                    num_sequences_global=4,
                )
        assert abs(float(total.detach()) - float(want.detach())) <= 1e-12 * abs(float(want.detach())), reduction
    with pytest.raises(ValueError, match="num_loss_tokens_global"):
        token_loss(logits_full[None], torch.zeros(1, sum(lens), dtype=torch.long))


def test_dp_rank_from_device_mesh():
    class Mesh:  # the DeviceMesh calls the sampler uses
        mesh_dim_names = ("dp", "cp")

        def __init__(self, dp, r):
            self.dp, self.r = dp, r

        def size(self, dim):
            return (self.dp, 2)[dim]

        def get_local_rank(self, name):
            return self.r

    assert BalancedBatchSampler(LENGTHS, TOPO, COST, device_mesh=Mesh(4, 3)).dp_rank == 3
    with pytest.raises(ValueError, match="device mesh"):
        BalancedBatchSampler(LENGTHS, TOPO, COST, device_mesh=Mesh(2, 1))


def test_predicted_step_bound_with_fixed_cost():
    from balancer.training.sampler import BalancedBatchSampler

    lengths = np.random.default_rng(0).integers(100, 3000, 400)
    topo = Topology(dp=2, cp=2, pp=3, micro_batches=4, max_tokens=4096)
    s = BalancedBatchSampler(lengths, topo, CostModel(2 / 53000, 1.0, fixed=5000.0), dp_rank=0, seed=0)
    for step in range(3):
        info = s.predicted_step(step)
        assert info["imbalance"] >= 1 - 1e-9
        assert info["lower_bound"] <= info["step_time"] * (1 + 1e-9)


# ---- a sampler state is untrusted input: every field is checked ---------------------------------------------------
def _good_state():
    s = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, seed=0)
    it = iter(s)
    next(it), next(it), next(it)
    return s.state_dict()


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda st: st.__setitem__("position", -1), "position"),
        (lambda st: st.__setitem__("epoch", -2), "epoch"),
        (lambda st: st.__setitem__("position", "3"), "position"),
        (lambda st: st.__setitem__("position", True), "position"),
        (lambda st: st.pop("segments"), "segments"),
        (lambda st: st.pop("seed"), "seed"),
        (lambda st: st.__setitem__("segments", []), "segments"),
        (lambda st: st["segments"][0].__setitem__("topology", {"dp": -1}), "segments\\[0\\]"),
        (lambda st: st["segments"].insert(0, {**st["segments"][0], "steps": -3}), "steps"),
        (lambda st: st.__setitem__("overflow", "drop"), "overflow"),
        (lambda st: st.__setitem__("fingerprint", 5), "fingerprint"),
    ],
)
def test_load_state_rejects_lying_states(edit, field):
    state = json.loads(json.dumps(_good_state()))
    edit(state)
    s = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, seed=0)
    with pytest.raises(ValueError, match=field):
        s.load_state_dict(state)


def test_runaway_split_document_fails_fast():
    lengths = np.array([5, 2**40, 7, 9])
    with pytest.raises(ValueError, match=r"document 1 .*limit of \d+ windows"):
        len(BalancedBatchSampler(lengths, Topology(dp=1, max_tokens=4096), COST, dp_rank=0, overflow="split"))
