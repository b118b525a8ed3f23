"""BalancedScheduler (the plan per step as Megatron's loop takes it) and CPCoreAttention in one process.

- per step: `num_microbatches` is the plan's count, the iterator yields exactly the sampler's micro-batches of the
  step as batch dicts, every document of the epoch once; an iterator left unfinished is refused at the next step;
  resume from `state_dict` at a step boundary continues with the same micro-batches;
- `CPCoreAttention` in a megatron-core `GPTModel` on packed THD (world of 1) equals the model run on each document
  alone (sbhd), forward and backward, for all three layouts; its refusals name the cause.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not importable (tools/setup.sh test installs megatron-core 0.19.2)"
)

from balancer.integrations.megatron import BalancedScheduler  # noqa: E402
from balancer.planning import CostModel, Topology  # noqa: E402
from balancer.training import BalancedBatchSampler  # noqa: E402

VOCAB = 40


def _corpus(n=40, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 30, n)
    g = torch.Generator().manual_seed(seed)
    return lengths, [torch.randint(0, VOCAB, (int(x),), generator=g) for x in lengths]


def _sampler(lengths, dp_rank=0, dp=2):
    topo = Topology(dp=dp, cp=1, micro_batches=3, max_tokens=40, tokens_per_step=160)
    return BalancedBatchSampler(lengths, topo, CostModel(1.0, 10.0), dp_rank=dp_rank, window_docs=len(lengths))


def test_steps_hand_out_the_plan():
    lengths, docs = _corpus()
    seen = []
    for dp_rank in range(2):
        sched = BalancedScheduler(_sampler(lengths, dp_rank), docs, layout="hybrid", with_params=False)
        ref = _sampler(lengths, dp_rank)
        steps = 0
        for step in sched:
            assert step.step == steps and step.num_microbatches == ref.step_micro_batches(steps)
            assert step.loss_tokens == ref.step_loss_tokens(steps) and step.tokens == ref.step_tokens(steps)
            batches = list(step.data_iterator)
            assert len(batches) == step.num_microbatches
            for m, b in enumerate(batches):
                want = ref.micro_batch(steps, m)
                assert b["num_tokens"] == int(lengths[want].sum()) and b["cp_group_key"] == (dp_rank, 1)
                assert b["tokens"].shape == (1, b["num_tokens"]) and "packed_seq_params" not in b
                seen += list(want)
            steps += 1
        assert steps == ref.num_steps > 1
    assert sorted(seen) == list(range(len(lengths)))


def test_an_unfinished_step_is_refused():
    lengths, docs = _corpus()
    sched = BalancedScheduler(_sampler(lengths), docs, with_params=False)
    step = sched.next_step()
    next(step.data_iterator)
    with pytest.raises(ValueError, match="handed out 1 of its 3 micro-batches"):
        sched.next_step()


def test_resume_at_a_step_boundary():
    lengths, docs = _corpus()
    sched = BalancedScheduler(_sampler(lengths), docs, with_params=False)
    first = sched.next_step()
    list(first.data_iterator)
    state = sched.state_dict()
    expected = [b["tokens"] for b in sched.next_step().data_iterator]
    again = BalancedScheduler(_sampler(lengths), docs, with_params=False)
    again.load_state_dict(state)
    step = again.next_step()
    assert step.step == 1
    got = [b["tokens"] for b in step.data_iterator]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_arguments_are_checked():
    lengths, docs = _corpus()
    with pytest.raises(TypeError, match="BalancedBatchSampler"):
        BalancedScheduler(object(), docs)
    with pytest.raises(ValueError, match="layout must be one of"):
        BalancedScheduler(_sampler(lengths), docs, layout="ring")
    topo = Topology(dp=1, cp=2, micro_batches=1, max_tokens=40, tokens_per_step=60)
    sampler = BalancedBatchSampler(lengths, topo, CostModel(1.0, 10.0), rank=0, window_docs=len(lengths))
    step = BalancedScheduler(sampler, docs, with_params=False).next_step()
    with pytest.raises(ValueError, match="pass groups=balancer.cp_groups"):
        next(step.data_iterator)


@pytest.fixture(scope="module")
def gpt():
    """A 2-layer float64 GPTModel whose core attention is CPCoreAttention, in a gloo world of 1."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from support.dist import free_port

    from balancer.integrations.megatron import CPCoreAttention

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CPCoreAttention.using("allgather")
    torch.manual_seed(0)
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="learned_absolute")
    yield model.double(), cfg
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["zigzag", "sequence", "hybrid"])
def test_packed_thd_equals_each_document_alone(gpt, layout):
    from balancer.integrations.megatron import megatron_batch, packed_seq_params

    model, _ = gpt
    _, docs = _corpus(5, seed=3)
    b = megatron_batch(range(5), docs, layout=layout)
    model.zero_grad()
    packed = model(b["tokens"], b["position_ids"], None, packed_seq_params=packed_seq_params(b))[0]
    packed.pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = [model(d[None], torch.arange(len(d))[None], None)[0] for d in docs]
    torch.cat(alone).pow(2).sum().backward()
    assert (packed - torch.cat(alone)).abs().max() <= 1e-12
    assert max((g - p.grad).abs().max() for g, p in zip(grads, model.parameters())) <= 1e-10


def test_core_attention_refuses_what_it_cannot_reproduce(gpt):
    from megatron.core.transformer.enums import AttnMaskType

    from balancer.integrations.megatron import CPCoreAttention

    _, cfg = gpt
    with pytest.raises(ValueError, match="attention_dropout must be 0"):
        CPCoreAttention(cfg, 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    with pytest.raises(ValueError, match="mask types"):
        CPCoreAttention(cfg, 1, AttnMaskType.arbitrary, "self")
    with pytest.raises(ValueError, match="method must be one of"):
        CPCoreAttention.using("flash")


def test_a_plain_packed_seq_params_is_read_as_per_document_zigzag(gpt):
    from megatron.core.packed_seq_params import PackedSeqParams

    from balancer.integrations.megatron import megatron_batch
    from balancer.integrations.megatron.core_attention import thd_layout

    model, _ = gpt
    _, docs = _corpus(4, seed=5)
    b = megatron_batch(range(4), docs)
    cu = b["cu_seqlens"][0]
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40, max_seqlen_kv=40)
    out = model(b["tokens"], b["position_ids"], None, packed_seq_params=plain)[0]
    alone = torch.cat([model(d[None], torch.arange(len(d))[None], None)[0] for d in docs])
    assert (out - alone).abs().max() <= 1e-12
    padded = megatron_batch(range(4), docs, cp_rank=1, cp_size=2, layout="zigzag")
    pcu = padded["cu_seqlens_padded"][0]
    layout = thd_layout(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=pcu), 2)
    assert np.array_equal(layout.local_indices(1), padded["cp_layout"].local_indices(1))
    with pytest.raises(ValueError, match="divisible by 2\\*cp = 4"):
        thd_layout(PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 9])), 2)


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_core_attention_is_the_reference_attention(gpt, window):
    """The module alone on packed THD q/k/v (GQA): the plain masked softmax, the config's sliding window included."""
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType
    from support.attn_ref import reference

    from balancer.integrations.megatron import CPCoreAttention, megatron_batch, packed_seq_params

    _, cfg = gpt
    cfg = dataclasses.replace(cfg, window_size=window)
    module = CPCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    _, docs = _corpus(4, seed=7)
    b = megatron_batch(range(4), docs, layout="hybrid")
    g = torch.Generator().manual_seed(0)
    t = b["tokens"].shape[1]
    q = torch.randn(t, 4, 4, dtype=torch.float64, generator=g)
    k, v = (torch.randn(t, 2, 4, dtype=torch.float64, generator=g) for _ in range(2))
    out = module(q, k, v, None, packed_seq_params=packed_seq_params(b))
    want = reference(q, k, v, b["cu_seqlens"][0].numpy(), True, 0.5, window_size=window or (-1, -1))
    assert out.shape == (t, 16) and (out - want.reshape(t, 16)).abs().max() <= 1e-12
