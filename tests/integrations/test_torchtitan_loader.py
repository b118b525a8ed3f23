"""balancer.integrations.torchtitan.BalancedDataLoader against the real torchtitan 0.3.0 (built through torchtitan's
own Config.build): items per step, every document once, loss-masked fillers, exact resume, resume onto another DP
degree, the sources (a Hugging Face dataset folder, text tokenized with a torchtitan tokenizer, a pretokenized
folder), the monitor attached to its step source."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (tools/setup.sh test installs 0.3.0)")

import numpy as np
import torch

from balancer.integrations.torchtitan import BalancedDataLoader, PackedDocuments

COST = {"attn_coef": 1.0, "linear_coef": 40.0}
IGNORE = -100


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """120 documents of 2..59 tokens; every token of document i is 1000 + i (so a batch names its documents)."""
    import datasets

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 60, size=120)
    path = tmp_path_factory.mktemp("tt") / "docs"
    ds = datasets.Dataset.from_dict({"input_ids": [[1000 + i] * int(n) for i, n in enumerate(lengths)]})
    ds.save_to_disk(str(path))
    return str(path), lengths


def build(path, dp_world_size, dp_rank, **options):
    opts = dict(dataset_path=path, global_batch_size=8, cost=COST, seed=3)
    opts.update(options)
    return BalancedDataLoader.Config(**opts).build(
        dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=None, seq_len=64, local_batch_size=2,
        snapshot_every_n_steps=None,
    )  # fmt: skip


def doc_tokens(item) -> dict[int, int]:
    """{document: tokens} of one item (fillers and padding carry token 0)."""
    ids = item[0]["input"][0]
    docs, counts = torch.unique(ids[ids >= 1000], return_counts=True)
    return {int(d) - 1000: int(c) for d, c in zip(docs, counts)}


def test_items_per_step_and_every_document_once(hf_folder):
    path, lengths = hf_folder
    loaders = [build(path, 2, r) for r in range(2)]
    assert loaders[0].micro_batches == 8 // (2 * 2) == loaders[0].topology.micro_batches
    streams = [list(ld) for ld in loaders]
    assert len(streams[0]) == len(streams[1]) == loaders[0].sampler.num_steps * loaders[0].micro_batches
    seen: dict[int, int] = {}
    for stream in streams:
        for item in stream:
            inputs, labels = item
            assert set(inputs) == {"input", "positions", "attention_masks"}
            assert isinstance(inputs["attention_masks"], PackedDocuments)
            assert inputs["input"].shape == labels.shape == inputs["positions"].shape
            assert inputs["input"].shape[1] <= loaders[0].topology.max_tokens
            for d, n in doc_tokens(item).items():
                assert d not in seen
                seen[d] = n
    assert seen == {i: int(n) for i, n in enumerate(lengths)}
    loss_tokens = sum(int((lab != IGNORE).sum()) for s in streams for _, lab in s)
    assert loss_tokens == int((lengths - 1).sum())


def test_positions_restart_per_document_and_labels_shifted(hf_folder):
    path, _ = hf_folder
    inputs, labels = next(iter(build(path, 2, 1)))
    ids, pos, lab = inputs["input"][0], inputs["positions"][0], labels[0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
    for a, b in zip(starts[:-1], starts[1:]):
        assert torch.equal(pos[a:b], torch.arange(b - a))
        assert len(set(ids[a:b].tolist())) == 1
        assert torch.equal(lab[a : b - 1], ids[a + 1 : b]) and lab[b - 1] == IGNORE
    assert inputs["attention_masks"].cu_seqlens.tolist() == starts


@pytest.fixture(scope="module")
def five_docs(tmp_path_factory):
    """Five documents: a step of two replicas x four micro-batches cannot be filled (the plan's step has M' = 2)."""
    import datasets

    path = tmp_path_factory.mktemp("tt5") / "docs"
    datasets.Dataset.from_dict({"input_ids": [[1000 + i] * (20 + i) for i in range(5)]}).save_to_disk(str(path))
    return str(path)


def test_short_last_step_is_filled_with_loss_masked_items(five_docs):
    ld = build(five_docs, 2, 0, global_batch_size=16)  # M = 4
    s = ld.sampler
    assert s.num_steps == 1 and s.step_micro_batches(0) == 2 < ld.micro_batches == 4
    items = list(ld)
    assert len(items) == 4
    for inputs, labels in items[2:]:
        assert (labels == IGNORE).all() and not doc_tokens((inputs, labels))
        assert inputs["input"].numel() > 0
    assert all((lab != IGNORE).any() for _, lab in items[:2])


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_resume_inside_the_fillers_is_exact(five_docs, cut):
    full = list(build(five_docs, 2, 1, global_batch_size=16))
    ld = build(five_docs, 2, 1, global_batch_size=16)
    it = iter(ld)
    for _ in range(cut):
        next(it)
    again = build(five_docs, 2, 1, global_batch_size=16)
    again.load_state_dict(ld.state_dict())
    rest = list(again)
    assert len(rest) == 4 - cut
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[0]["input"], b[0]["input"]) for a, b in zip(rest, full[cut:]))


def test_a_finished_epoch_resumes_onto_another_dp_degree(five_docs):
    ld = build(five_docs, 2, 0, global_batch_size=16)
    assert len(list(ld)) == 4
    other = build(five_docs, 4, 0, global_batch_size=16)
    other.load_state_dict(ld.state_dict())
    assert list(other) == []


def test_resume_is_exact_at_every_item(hf_folder):
    path, _ = hf_folder
    full = list(build(path, 2, 1, global_batch_size=16))
    for cut in (1, 3, 4, len(full) - 2, len(full) - 1, len(full)):
        ld = build(path, 2, 1, global_batch_size=16)
        it = iter(ld)
        for _ in range(cut):
            next(it)
        state = ld.state_dict()
        again = build(path, 2, 1, global_batch_size=16)
        again.load_state_dict(state)
        rest = list(again)
        assert len(rest) == len(full) - cut
        for (a, la), (b, lb) in zip(rest, full[cut:]):
            assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)
            assert torch.equal(a["positions"], b["positions"])


def test_state_is_the_same_on_every_rank(hf_folder):
    path, _ = hf_folder
    loaders = [build(path, 2, r) for r in range(2)]
    iters = [iter(ld) for ld in loaders]
    for _ in range(5):
        for it in iters:
            next(it)
    assert loaders[0].state_dict() == loaders[1].state_dict()


def test_resume_onto_another_dp_degree(hf_folder):
    """Two ranks train 3 steps; the state resumes on four ranks (the same global batch: M 2 -> 1); every document
    comes exactly once over both runs."""
    path, lengths = hf_folder
    first = [build(path, 2, r) for r in range(2)]
    seen: dict[int, int] = {}

    def take(item):
        for d, n in doc_tokens(item).items():
            assert d not in seen, f"document {d} twice"
            seen[d] = n

    iters = [iter(ld) for ld in first]
    for _ in range(3 * first[0].micro_batches):
        for it in iters:
            take(next(it))
    state = first[0].state_dict()
    second = [build(path, 4, r) for r in range(4)]
    assert second[0].micro_batches == 1
    for ld in second:
        ld.load_state_dict(state)
    rest = [list(ld) for ld in second]
    assert len({len(r) for r in rest}) == 1
    for r in rest:
        for item in r:
            take(item)
    assert seen == {i: int(n) for i, n in enumerate(lengths)}


def test_mid_step_state_onto_another_dp_degree_is_refused(hf_folder):
    path, _ = hf_folder
    ld = build(path, 2, 0)
    next(iter(ld))
    with pytest.raises(ValueError, match="mid-step"):
        build(path, 4, 0).load_state_dict(ld.state_dict())


def test_infinite_runs_the_next_epoch(hf_folder):
    path, _ = hf_folder
    ld = build(path, 2, 0, infinite=True)
    n = ld.sampler.num_steps * ld.micro_batches
    it = iter(ld)
    first = [next(it) for _ in range(n)]
    second = [next(it) for _ in range(n)]
    assert ld.sampler.epoch == 1
    assert any(not torch.equal(a[0]["input"], b[0]["input"]) for a, b in zip(first, second))


def test_bad_settings_name_the_argument(hf_folder):
    path, _ = hf_folder
    with pytest.raises(ValueError, match="global_batch_size=10"):
        build(path, 2, 0, global_batch_size=10)
    with pytest.raises(ValueError, match="cp_degree=3"):
        build(path, 2, 0, cp_degree=3)
    with pytest.raises(ValueError, match="cost_path or cost"):
        build(path, 2, 0, cost_path="x.json")
    with pytest.raises(ValueError, match="neither"):
        build(path, 2, 0, column="tokens", text_column="body")
    with pytest.raises(ValueError, match="not a BalancedDataLoader state"):
        build(path, 2, 0).load_state_dict({"dp_rank_0": b""})


def test_long_document_is_refused_naming_seq_len(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"input_ids": [[1] * 10, [2] * 100]}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="100 tokens"):
        build(str(tmp_path / "d"), 1, 0, global_batch_size=2)  # 100 fits a micro-batch (2 x 64), not seq_len 64


def test_text_dataset_tokenized_with_a_torchtitan_tokenizer(tmp_path):
    import datasets
    from support.data_files import make_texts, train_hf_tokenizer
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    texts = make_texts(40, max_words=12)
    train_hf_tokenizer(tmp_path / "tok", texts)
    tok = HuggingFaceTokenizer(tokenizer_path=str(tmp_path / "tok"))
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "text"))
    ld = BalancedDataLoader.Config(dataset_path=str(tmp_path / "text"), global_batch_size=4, cost=COST).build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=1024, local_batch_size=2, snapshot_every_n_steps=1
    )
    want = sorted(tok.encode(t, add_bos=True, add_eos=True) for t in texts)
    got = []
    for inputs, _ in ld:
        ids, pos = inputs["input"][0].tolist(), inputs["positions"][0].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        got += [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]
    assert sorted(got) == want


def test_pretokenized_folder(tmp_path):
    from support.data_files import make_texts, write_jsonl

    from balancer.data.pretokenize import PretokenizeOptions, pretokenize

    write_jsonl(tmp_path / "c.jsonl", make_texts(30, max_words=10))
    pretokenize([str(tmp_path / "c.jsonl")], tmp_path / "tok", options=PretokenizeOptions(), progress=False)
    from balancer import ShardDataset

    lengths = np.asarray(ShardDataset(tmp_path / "tok").lengths)
    ld = BalancedDataLoader.Config(dataset_path=str(tmp_path / "tok"), global_batch_size=4, cost=COST).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=int(lengths.max()), local_batch_size=2
    )
    items = list(ld)
    assert sum(int((p == 0).sum()) for d, _ in items for p in [d["positions"]]) >= len(lengths)
    assert sum(int((lab != IGNORE).sum()) for _, lab in items) == int((lengths - 1).sum())


def test_a_monitor_attaches_to_the_loader(hf_folder):
    """The loader is a StepSource (the sampler's members): BalanceMonitor(loader) measures, reports and saves its
    state with the loader's."""
    from balancer import BalanceMonitor
    from balancer.measured.source import STEP_SOURCE_MEMBERS, StepSource

    path, _ = hf_folder
    ld = build(path, 1, 0, global_batch_size=4)
    assert isinstance(ld, StepSource) and STEP_SOURCE_MEMBERS
    monitor = BalanceMonitor(ld, warmup_steps=0)
    assert ld.monitor is monitor and ld.sampler.monitor is monitor
    it = iter(ld)
    for _step in range(3):
        for _ in range(ld.micro_batches):
            next(it)
            monitor.record(0.01)
        monitor.end_step()
    report = monitor.report()
    assert report["steps"] == 3
    assert ld.position == 3 * ld.micro_batches and ld.step_place(0).micro_batches == ld.micro_batches
    assert "monitor" in ld.state_dict()["balancer"]["sampler"]
    with pytest.raises(ValueError, match="already has a BalanceMonitor"):
        BalanceMonitor(ld)
