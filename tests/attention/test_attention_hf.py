"""A stock transformers LlamaForCausalLM (tiny config, random weights, no download) with the registered CP
attention on a gloo CP group equals the same model run document by document with stock attention: logits, loss and
parameter gradients (summed over ranks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.dist import run_world

transformers = pytest.importorskip("transformers")


def _model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    import attention.hf as ahf

    ahf.register()
    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double()


def _shifted_labels(ids: torch.Tensor, cu: np.ndarray) -> torch.Tensor:
    lab = torch.full_like(ids, -100)
    for a, b in zip(cu[:-1], cu[1:]):
        lab[a : b - 1] = ids[a + 1 : b]
    return lab


def _worker(rank, world, method):
    import attention
    import attention.hf as ahf

    lens = np.array([5, 1, 23, 3, 14, 2 * world + 1])
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    ids = torch.randint(0, 61, (T,), generator=torch.Generator().manual_seed(1))
    labels = _shifted_labels(ids, cu)
    n_labels = int((labels != -100).sum())

    ref = _model("sdpa")
    logits_ref, loss_ref = [], 0.0
    for a, b in zip(cu[:-1], cu[1:]):  # stock attention, one document at a time
        lg = ref(input_ids=ids[None, a:b], position_ids=torch.arange(b - a)[None]).logits[0]
        logits_ref.append(lg)
        loss_ref = loss_ref + torch.nn.functional.cross_entropy(lg, labels[a:b], ignore_index=-100, reduction="sum")
    logits_ref = torch.cat(logits_ref)
    (loss_ref / n_labels).backward()

    model = _model(ahf.NAME)
    model.load_state_dict(ref.state_dict())
    layout = attention.CPLayout.build(cu, world)
    ids_l = layout.shard(ids, rank)[None]
    pos_l = torch.from_numpy(layout.position_ids(rank))[None]
    lab_l = layout.shard(labels, rank)
    with ahf.cp_context(layout, method=method):
        out = model(input_ids=ids_l, position_ids=pos_l)
        hf_loss = model(input_ids=ids_l, position_ids=pos_l, labels=lab_l[None], shift_labels=lab_l[None]).loss
    logits = out.logits[0]
    assert (logits - layout.shard(logits_ref, rank)).abs().max() <= 1e-9 * logits_ref.abs().max()
    loss = torch.nn.functional.cross_entropy(logits, lab_l, ignore_index=-100, reduction="sum")
    n_local = int((lab_l != -100).sum())
    if n_local:
        # transformers computes its loss in float32
        assert abs(float(hf_loss) - float(loss) / n_local) <= 1e-5 * abs(float(loss) / n_local)
    (loss / n_labels).backward()
    total = torch.tensor([float(loss)], dtype=torch.float64)
    dist.all_reduce(total)
    assert abs(float(total) / n_labels - float(loss_ref) / n_labels) <= 1e-10
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # data-parallel style sum over the CP ranks
        assert (g - pr.grad).abs().max() <= 1e-9 * max(float(pr.grad.abs().max()), 1e-12), name


@pytest.mark.slow  # multi-process gloo
@pytest.mark.parametrize("world,method", [(2, "ring"), (3, "allgather")])
def test_llama_packed_cp_equals_per_document(world, method):
    run_world(world, _worker, method)


def test_needs_context():
    import attention.hf as ahf

    model = _model(ahf.register())
    with pytest.raises(RuntimeError, match="cp_context"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def _one_rank_inputs():
    import attention

    cu = np.array([0, 4, 11])
    layout = attention.CPLayout.build(cu, 1)
    ids = torch.randint(0, 61, (1, 11), generator=torch.Generator().manual_seed(2))
    return layout, ids, torch.from_numpy(layout.position_ids(0))[None]


def test_attention_mask_all_ones_accepted_padding_refused():
    """A padding mask of all ones changes nothing; one with a zero (padding) raises instead of being ignored (also
    through transformers, which drops the mask of an attention it does not know unless told); a 4-D mask raises."""
    import attention.hf as ahf

    model = _model(ahf.register())
    layout, ids, pos = _one_rank_inputs()
    with ahf.cp_context(layout):
        plain = model(input_ids=ids, position_ids=pos).logits
        ones = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(plain, ones)
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask has zeros"):
        with ahf.cp_context(layout):
            model(input_ids=ids, position_ids=pos, attention_mask=padded)
    q = torch.zeros(1, 4, 11, 8, dtype=torch.float64)
    k = torch.zeros(1, 2, 11, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="custom attention_mask"):
        with ahf.cp_context(layout):
            mask = torch.ones(1, 1, 11, 11, dtype=torch.bool)
            ahf.cp_attention_forward(model.model.layers[0].self_attn, q, k, k, mask)


def test_unknown_keywords_refused_documented_ones_ignored():
    """Keywords that reach the attention function: the documented ignored ones (docs/attention.md) are accepted
    without changing the output; an unknown one, output_attentions=True and attention sinks raise."""
    from pathlib import Path

    import attention.hf as ahf

    model = _model(ahf.register())
    module = model.model.layers[0].self_attn
    layout, _, pos = _one_rank_inputs()
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 11, 8, generator=g, dtype=torch.float64), torch.randn(1, 2, 11, 8, generator=g).double()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "attention.md").read_text()
    with ahf.cp_context(layout):
        base = ahf.cp_attention_forward(module, q, k, k, None)[0]
        ignored = {name: None for name in ahf.IGNORED}
        ignored.update(position_ids=pos, use_cache=False, output_attentions=False)
        assert torch.equal(ahf.cp_attention_forward(module, q, k, k, None, **ignored)[0], base)
        for bad, match in (
            ({"block_indices": torch.zeros(3)}, "does not know"),
            ({"output_attentions": True}, "attention weights"),
            ({"s_aux": torch.zeros(4)}, "attention sinks"),
        ):
            with pytest.raises(ValueError, match=match):
                ahf.cp_attention_forward(module, q, k, k, None, **bad)
    assert all(f"`{name}`" in docs for name in ahf.IGNORED), "docs/attention.md must list every ignored keyword"
