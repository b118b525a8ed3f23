"""Stock transformers Mistral (sliding window 16), Gemma 2 (sliding window + attention logit softcap) and Llama, tiny
configs in float64, through attention.hf on 2 gloo ranks: logits equal the stock eager model run document by
document (within 1e-5 of the largest logit: eager Gemma 2 runs its softmax in float32). What cp_attention cannot
reproduce raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.dist import run_world

pytestmark = pytest.mark.slow  # multi-process gloo, real transformers models

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def _model(family: str, attn: str):
    import attention.hf as ahf

    ahf.register()
    if family == "mistral":
        cfg = transformers.MistralConfig(**SMALL, sliding_window=16, attn_implementation=attn)
        cls = transformers.MistralForCausalLM
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**SMALL, head_dim=8, sliding_window=16, attn_logit_softcapping=5.0,
                                        final_logit_softcapping=None, query_pre_attn_scalar=8,
                                        attn_implementation=attn)  # fmt: skip
        cls = transformers.Gemma2ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**SMALL, attn_implementation=attn)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return cls(cfg).double().eval()


def _worker(rank, world, family, method):
    import attention
    import attention.hf as ahf

    lens = np.array([40, 5, 23, 2 * world + 1])
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = torch.randint(0, 61, (int(cu[-1]),), generator=torch.Generator().manual_seed(1))
    ref = _model(family, "eager")
    with torch.no_grad():
        logits_ref = torch.cat(
            [
                ref(input_ids=ids[None, a:b], position_ids=torch.arange(b - a)[None]).logits[0]
                for a, b in zip(cu[:-1], cu[1:])
            ]
        )
        model = _model(family, ahf.NAME)
        model.load_state_dict(ref.state_dict())
        layout = attention.CPLayout.build(cu, world)
        pos = torch.from_numpy(layout.position_ids(rank))[None]
        with ahf.cp_context(layout, method=method):
            logits = model(input_ids=layout.shard(ids, rank)[None], position_ids=pos).logits[0]
    err = float((logits - layout.shard(logits_ref, rank)).abs().max()) / float(logits_ref.abs().max())
    assert err <= 1e-5, (family, method, err)


def _worker_all(rank, world):
    for family, method in (("mistral", "ring"), ("gemma2", "ulysses"), ("llama", "allgather")):
        _worker(rank, world, family, method)


def test_stock_models_match_eager():
    run_world(2, _worker_all)  # one world: the transformers import is paid once


def test_what_cannot_be_reproduced_raises():
    from attention.hf import _masks_from_kwargs

    assert _masks_from_kwargs(True, {"sliding_window": 16, "softcap": 50.0}) == ((15, -1), 50.0)
    assert _masks_from_kwargs(False, {"sliding_window": 4}) == ((3, 3), 0.0)
    assert _masks_from_kwargs(True, {"sliding_window": None, "softcap": None}) == ((-1, -1), 0.0)
    for name in ("s_aux", "alibi_slopes"):
        with pytest.raises(ValueError, match="cannot reproduce"):
            _masks_from_kwargs(True, {name: torch.zeros(2)})
