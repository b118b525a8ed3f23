"""torchtitan's llama3 model (a tiny config) trained in float64 on CPU gloo from BalancedDataLoader (built through
torchtitan's own Config.build) with PackedAttention, equal to unpacked training (every document its own row, a
dense causal softmax) within 1e-9, at DP 2 and at CP 2 (the project's layouts and exact CP attention)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (tools/setup.sh test installs 0.3.0)")

import numpy as np
import torch
import torch.nn.functional as F
from support.dist import run_world
from torchtitan.protocols.module import Module

from balancer.integrations.torchtitan import BalancedDataLoader, use_packed_attention

VOCAB, SEQ, LBS, STEPS, LR = 256, 64, 2, 3, 0.5
COST = {"attn_coef": 1.0, "linear_coef": 40.0}
IGNORE = -100


class DenseCausal(Module):
    """The reference inner attention: one unpacked document per row, a plain float64 causal softmax."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2)


def tiny_model_config():
    """A llama3 config of torchtitan's own building blocks: 2 layers, dim 32, 4 heads, 2 KV heads (GQA), vocabulary
    256, RoPE over SEQ positions (flex attention, to be replaced)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    dim = 32
    return Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, hidden_dim=64, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // 4, max_seq_len=SEQ, theta=10000.0),
        ),
    )  # fmt: skip


def tiny_llama(packed: bool):
    """The tiny llama3 in float64, the same weights every call: PackedAttention (packed) or DenseCausal."""
    cfg = tiny_model_config()
    if packed:
        use_packed_attention(cfg, method="allgather")
    else:
        for layer in cfg.layers:
            layer.attention.inner_attention = DenseCausal.Config()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = cfg.build()
        model.init_states()
    finally:
        torch.set_default_dtype(default)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    return model


def loader_config(path: str, cp_degree: int, layout: str) -> BalancedDataLoader.Config:
    return BalancedDataLoader.Config(dataset_path=path, global_batch_size=8, cp_degree=cp_degree, layout=layout,
                                     cost=COST, seed=1)  # fmt: skip


def packed_worker(rank: int, world: int, path: str, cp_degree: int, layout: str, out: str) -> None:
    """One rank: the loader built by torchtitan's Config.build, the model's forward on its items, the loss summed
    and divided by the step's global count of labels that are not ignored (as torchtitan's trainer does), the
    gradients summed over every rank, SGD."""
    import torch.distributed as dist

    model = tiny_llama(packed=True)
    loader = loader_config(path, cp_degree, layout).build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=LBS, snapshot_every_n_steps=1
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    it, steps = iter(loader), []
    for step in range(STEPS):
        items = [next(it) for _ in range(loader.micro_batches)]
        tokens = torch.tensor(sum(int((lab != IGNORE).sum()) for _, lab in items), dtype=torch.float64)
        dist.all_reduce(tokens)
        assert int(tokens) == loader.sampler.step_loss_tokens(step)
        for inputs, labels in items:
            kwargs = {k: v for k, v in inputs.items() if k != "input"}
            logits = model(inputs["input"], **kwargs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
            (loss / tokens).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        t = loader.topology
        steps.append([loader.sampler.micro_batch(step, m, dp_rank=d) for d in range(t.dp)
                      for m in range(loader.sampler.step_micro_batches(step))])  # fmt: skip
    if rank == 0:
        torch.save({"params": dict(model.named_parameters()), "steps": json.dumps(steps)}, out)


def unpacked_training(path: str, steps: list) -> dict:
    import datasets

    rows = datasets.load_from_disk(path)["input_ids"]
    model = tiny_llama(packed=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in steps:
        docs = [d for mb in step for d in mb]
        tokens = sum(len(rows[d]) - 1 for d in docs)
        for d in docs:
            ids = torch.tensor(rows[d])[None]
            logits = model(ids, positions=torch.arange(ids.shape[1])[None])
            (F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum") / tokens).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import datasets

    rng = np.random.default_rng(5)
    lengths = rng.integers(3, 60, size=48)
    path = tmp_path_factory.mktemp("ttrain") / "docs"
    rows = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in lengths]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("cp_degree,layout", [(1, "zigzag"), (2, "zigzag"), (2, "hybrid")],
                         ids=["dp2", "cp2", "cp2-hybrid"])  # fmt: skip
def test_packed_training_equals_unpacked(corpus, cp_degree, layout, tmp_path):
    out = str(tmp_path / "packed.pt")
    run_world(2, packed_worker, corpus, cp_degree, layout, out)
    got = torch.load(out)
    steps = json.loads(got["steps"])
    assert len(steps) == STEPS and all(steps)
    want = unpacked_training(corpus, steps)
    start = tiny_llama(packed=False)
    moved = max(float((want[k] - p).detach().abs().max()) for k, p in start.named_parameters())
    assert moved > 1e-3  # the steps changed the weights: the comparison below is not trivially true
    worst = max(float((got["params"][k] - want[k]).detach().abs().max()) for k in want)
    assert worst <= 1e-9, worst


def test_use_packed_attention_replaces_every_layer_and_checks_its_input():
    from balancer.integrations.torchtitan import PackedAttention

    cfg = use_packed_attention(tiny_model_config(), method="ring")
    assert all(isinstance(layer.attention.inner_attention, PackedAttention.Config) for layer in cfg.layers)
    attn = cfg.layers[0].attention.inner_attention.build()
    q = torch.zeros(1, 4, 4, 8)
    with pytest.raises(TypeError, match="PackedDocuments"):
        attn(q, q, q, attention_masks=None)
    with pytest.raises(ValueError, match="method must be one of"):
        PackedAttention.Config(method="flash").build()
    with pytest.raises(TypeError, match="Decoder.Config"):
        use_packed_attention(object())
