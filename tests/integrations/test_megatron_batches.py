"""balancer.integrations.megatron batches against megatron-core 0.19.2's own code, in one process.

- every layout: each CP rank's share, put back together, is the padded row; every real token once; positions
  restart per document; pre-shifted targets; padding counted (property test);
- Megatron's per-sequence CP slicing (`get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)`) of the full
  padded row gives each rank exactly the "sequence" layout's share;
- Megatron's THD rotary under CP (`_apply_rotary_pos_emb_thd`, which picks the per-document zigzag chunks itself
  from `cu_seqlens_padded`) on each rank's "zigzag" share equals rotary of the whole row at the true positions,
  then sharded: the shares are the ones Megatron's per-document path assumes (its own partition helper is
  Transformer Engine's `thd_get_partitioned_indices`, absent on CPU);
- `packed_seq_params` is a real `PackedSeqParams`.

Megatron's helpers read only the CP group's size and rank; they get them from torch's fake process group (a
`torch.distributed` backend that knows rank and size and moves no data), re-initialised per rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip(
    "megatron.core", reason="megatron-core is not importable (tools/setup.sh test installs megatron-core 0.19.2)"
)

from balancer.integrations.megatron import megatron_batch, packed_seq_params  # noqa: E402
from balancer.training import CPGroup, Member, Span  # noqa: E402

LAYOUTS = ("zigzag", "sequence", "hybrid")


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (int(n),), generator=g) for n in lengths]


def _expected_padding(lengths, cp, layout):
    lens = np.asarray(lengths)
    if cp == 1 or layout == "hybrid":
        return 0
    if layout == "zigzag":
        return int((-lens % (2 * cp)).sum())
    return int(-lens.sum() % (2 * cp))


def _gather(parts, layout):
    return layout.unshard([p[0] for p in parts])


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    cp=st.integers(1, 4),
    layout=st.sampled_from(LAYOUTS),
)
def test_shares_rebuild_the_padded_row(lengths, cp, layout):
    docs = _docs(lengths)
    batches = [megatron_batch(list(range(len(docs))), docs, cp_rank=r, cp_size=cp, layout=layout) for r in range(cp)]
    b0, lay = batches[0], batches[0]["cp_layout"]
    pcu = b0["cu_seqlens_padded"][0].numpy().astype(np.int64)
    cu = b0["cu_seqlens"][0].numpy().astype(np.int64)
    assert cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert b0["num_pad_tokens"] == _expected_padding(lengths, cp, layout) == pcu[-1] - cu[-1]
    assert b0["num_tokens"] == sum(lengths) and b0["num_loss_tokens"] == sum(lengths) - len(lengths)
    assert int(b0["max_seqlen"][0]) == int(np.diff(pcu).max())
    tokens = _gather([b["tokens"] for b in batches], lay)
    labels = _gather([b["labels"] for b in batches], lay)
    mask = _gather([b["loss_mask"] for b in batches], lay)
    pos = _gather([b["position_ids"] for b in batches], lay)
    assert sum(float(b["loss_mask"].sum()) for b in batches) == b0["num_loss_tokens"]
    for d, doc in enumerate(docs):
        a, n = int(pcu[d]), len(doc)
        assert torch.equal(tokens[a : a + n], doc)
        assert torch.equal(labels[a : a + n - 1], doc[1:]) and mask[a : a + n - 1].all()
        assert not mask[a + n - 1 : int(pcu[d + 1])].any()  # the last token and the document's padding
        assert torch.equal(pos[a : int(pcu[d + 1])], torch.arange(int(pcu[d + 1]) - a))
    if layout == "zigzag" and cp > 1:
        assert (np.diff(pcu) % (2 * cp) == 0).all()
        assert len({b["tokens"].shape[1] for b in batches}) == 1


@pytest.fixture
def fake_world():
    """`init(rank, size)`: a fake torch.distributed world of `size` where this process is `rank`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank, size):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        return dist.group.WORLD

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _full_row(docs, cp, layout):
    """The padded full row built here from the documents (Megatron's input to its own CP slicing)."""
    lens = np.array([len(d) for d in docs])
    unit = 2 * cp
    if layout == "zigzag":
        pads = -lens % unit
    else:
        pads = np.zeros_like(lens)
        pads[-1] = -lens.sum() % unit
    tokens, pos = [], []
    for d, p in zip(docs, pads):
        tokens += [d, torch.zeros(int(p), dtype=torch.int64)]
        pos.append(torch.arange(len(d) + int(p)))
    return torch.cat(tokens), torch.cat(pos), np.concatenate([[0], np.cumsum(lens + pads)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6), cp=st.integers(2, 4))
def test_megatron_per_sequence_slicing_is_the_sequence_layout(fake_world, lengths, cp):
    from megatron.core.utils import get_batch_on_this_cp_rank

    docs = _docs(lengths, seed=cp)
    tokens, pos, pcu = _full_row(docs, cp, "sequence")
    for r in range(cp):
        group = fake_world(r, cp)
        full = {"tokens": tokens[None].clone(), "position_ids": pos[None].clone(), "cu_seqlens": torch.tensor(pcu)}
        theirs = get_batch_on_this_cp_rank(full, is_hybrid_cp=False, cp_group=group, use_per_sequence_balancing=True)
        ours = megatron_batch(range(len(docs)), docs, cp_rank=r, cp_size=cp, layout="sequence")
        assert torch.equal(ours["tokens"], theirs["tokens"])
        assert torch.equal(ours["position_ids"], theirs["position_ids"])


def _rope_freqs(length, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    f = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]


@pytest.mark.parametrize("cp", [2, 4])
def test_megatron_thd_rotary_reads_the_zigzag_shares(fake_world, cp):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, _apply_rotary_pos_emb_thd

    docs = _docs([9, 16, 3, 21], seed=cp)
    tokens, pos, pcu = _full_row(docs, cp, "zigzag")
    heads, dim = 2, 8
    x = torch.randn(len(tokens), heads, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    freqs = _rope_freqs(int(np.diff(pcu).max()), dim)
    whole = _apply_rotary_pos_emb_bshd(x[:, None], freqs[pos])[:, 0]  # true positions, no CP
    for r in range(cp):
        group = fake_world(r, cp)
        ours = megatron_batch(range(len(docs)), docs, cp_rank=r, cp_size=cp, layout="zigzag")
        lay = ours["cp_layout"]
        local = _apply_rotary_pos_emb_thd(lay.shard(x, r), torch.tensor(pcu, dtype=torch.int32), freqs, cp_group=group)
        assert torch.allclose(local, lay.shard(whole, r), atol=1e-12, rtol=0)
        assert torch.equal(ours["tokens"][0], lay.shard(tokens, r))


def test_packed_seq_params_is_megatrons():
    from megatron.core.packed_seq_params import PackedSeqParams

    docs = _docs([5, 9, 3])
    b = megatron_batch([0, 1, 2], docs, cp_rank=1, cp_size=2, layout="zigzag")
    p = packed_seq_params(b)
    assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 5, 14, 17]
    assert p.cu_seqlens_q_padded.tolist() == [0, 8, 20, 24] and p.cu_seqlens_q_padded.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 12
    assert p.local_cp_size is None and p.cp_group is None and p.cp_layout is b["cp_layout"]


def test_dynamic_cp_items_set_the_group_and_local_cp_size():
    docs = _docs([10, 6, 4])
    group = CPGroup(4, 2, 1)
    items = [Member(0, group), Span(1, 2, 6, group)]
    b = megatron_batch(items, docs, layout="hybrid")
    assert (b["cp_rank"], b["cp_size"], b["cp_group_key"]) == (1, 2, (4, 2))
    assert int(b["local_cp_size"]) == 2 and b["num_pad_tokens"] == 0
    assert b["cu_seqlens"][0].tolist() == [0, 10, 14]
    p = packed_seq_params(b)
    assert p.local_cp_size == 2
    with pytest.raises(ValueError, match="contradict the items' CP group"):
        megatron_batch(items, docs, cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="different CP groups"):
        megatron_batch([Member(0, group), 2], docs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"layout": "contiguous"}, "layout must be one of"),
        ({"layout": {"kind": "zigzag", "split_threshold": 4}}, "takes no options"),
        ({"cp_size": 0}, "cp_size must be a positive int"),
        ({"cp_rank": 2, "cp_size": 2}, "cp_rank 2 out of range"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        megatron_batch([0], _docs([4]), **kwargs)


def test_empty_items_and_bad_spans_are_refused():
    docs = _docs([4])
    with pytest.raises(ValueError, match="items is empty"):
        megatron_batch([], docs)
    with pytest.raises(ValueError, match="out of range for document 0"):
        megatron_batch([Span(0, 2, 9)], docs)
    with pytest.raises(ValueError, match="pass a dict made by megatron_batch"):
        packed_seq_params({"tokens": torch.zeros(1, 3)})
