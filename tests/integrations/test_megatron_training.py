"""A tiny megatron-core 0.19.2 `GPTModel` trained on gloo with `BalancedScheduler` equals unpacked training.

Every rank runs Megatron's own schedule (`get_forward_backward_func()`) with the scheduler's data iterator and
`num_microbatches`, the model's core attention being `CPCoreAttention`; the gradients are summed over the DP x CP
ranks and divided by the step's global loss-token count (the plan's), then SGD. The reference trains the same
weights in one process, every document (or piece of one) run alone as an unpacked sequence through a plain
masked-softmax core attention written here. Float64 throughout: losses and parameters agree within 1e-9.

- dp 2 x cp 2 (static plan), each layout (zigzag padded to 2 x cp, per-sequence zigzag, hybrid) with two CP methods
  (ring, Ulysses, all-gather; `RUNS`), and the sbhd path (no packed params, rows sliced by Megatron's own
  `get_batch_on_this_cp_rank`) gives the THD path's logits;
- dynamic CP over a pool of 4 (groups of 1, 2 and 4 ranks per micro-batch, the group from the plan), each layout
  with the third method: every (layout, method) pair runs with CP > 1;
- dp 2 x pp 2 through Megatron's 1F1B schedule with variable sequence lengths.

Test-side shims of CUDA calls (`cuda_shims`): Megatron's schedules allocate their token counter with
`torch.zeros(..., device="cuda")` (schedules.py, every schedule), and its pipeline p2p code allocates receive
buffers on `torch.cuda.current_device()` and calls `torch.cuda.synchronize()` (p2p_communication.py); during a
schedule call those two modules see a `torch` whose `cuda` device is the CPU. Megatron's built-in loss computes in
float32, so the model runs without labels (float64 logits) and the loss is a float64 cross-entropy here.
"""

from __future__ import annotations

import contextlib
import math
import types
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not importable (tools/setup.sh test installs megatron-core 0.19.2)"
)

from support.dist import run_world  # noqa: E402

VOCAB, HIDDEN, LAYERS, STEPS, LR = 48, 16, 2, 2, 0.5
RUNS = {  # case -> the (layout, CP method) pairs its world trains: every pair of the nine with CP > 1
    "static": [("zigzag", "ulysses"), ("zigzag", "ring"), ("sequence", "ring"), ("sequence", "allgather"),
               ("hybrid", "allgather"), ("hybrid", "ulysses")],
    "dynamic": [("zigzag", "allgather"), ("sequence", "ulysses"), ("hybrid", "ring")],
    "pp": [("zigzag", "ring")],
}  # fmt: skip


class _CPUTorch(types.ModuleType):
    """`torch` as Megatron's schedule modules see it under `cuda_shims`: "cuda" allocations land on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(current_device=lambda: torch.device("cpu"), synchronize=lambda: None)

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def cuda_shims():
    """Test-side shim (module docstring): Megatron's schedules and p2p module on a CPU-only machine."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    saved = schedules.torch, p2p_communication.torch
    schedules.torch = p2p_communication.torch = _CPUTorch()
    try:
        yield
    finally:
        schedules.torch, p2p_communication.torch = saved


class ReferenceAttention(torch.nn.Module):
    """Plain causal masked softmax over one unpacked sequence (sbhd, [s, 1, h, d]), GQA by repeating K/V heads."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, **_):
        super().__init__()
        self.scale = 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **_):
        q, k, v = (x[:, 0] for x in (query, key, value))
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        s = s.masked_fill(torch.ones_like(s[0], dtype=torch.bool).triu(1), -math.inf)
        out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        return out.reshape(out.shape[0], 1, -1)


def _init(model, stage: int):
    """Every parameter drawn from a seed of its full-model name: a pipeline stage holds the same values as the
    layers it owns in the whole model."""
    with torch.no_grad():
        for key, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(_stage_key(key, stage).encode()))
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
                + (1.0 if key.endswith("norm.weight") else 0.0)
            )
    return model


def _gpt(core_attention, pre_process=True, post_process=True, num_layers=LAYERS, pp=1, stage=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
        calculate_per_token_loss=True, pipeline_model_parallel_size=pp, variable_seq_lengths=pp > 1,
        pipeline_dtype=torch.float64, moe_token_dispatcher_type="alltoall",  # variable_seq_lengths asks for it
    )  # fmt: skip
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = core_attention
    torch.manual_seed(0)
    model = GPTModel(
        cfg, spec, vocab_size=VOCAB, max_sequence_length=256, position_embedding_type="learned_absolute",
        pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=False,
    )  # fmt: skip
    return _init(model.double(), stage)


def _token_losses(logits, labels, mask):
    lp = torch.log_softmax(logits.double(), -1)
    return -(lp.gather(-1, labels[:, None])[:, 0] * mask.double()).sum()


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])

    def loss_func(logits):
        loss = _token_losses(logits[0], batch["labels"][0], batch["loss_mask"][0])
        return loss, batch["loss_mask"].sum().to(torch.int), {"loss": loss.detach()}

    return out, loss_func


def _data(seed, n, long):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([long, rng.integers(2, 14, n - len(long))])
    g = torch.Generator().manual_seed(seed)
    return lengths, [torch.randint(0, VOCAB, (int(x),), generator=g) for x in lengths]


def _setup(case):
    from balancer.planning import CostModel, Topology

    if case == "dynamic":
        from balancer.planning.dynamic import plan as dynamic

        dynamic.SPLIT_SLACK = 0.5  # a tiny plan: let the planner cut groups freely so that every size is used
        topo = Topology(dp=4, cp=1, micro_batches=2, max_tokens=24, tokens_per_step=150, cp_sizes=(1, 2, 4))
    elif case == "pp":
        topo = Topology(dp=2, cp=1, pp=2, micro_batches=3, max_tokens=40, tokens_per_step=150)
    else:  # static
        topo = Topology(dp=2, cp=2, micro_batches=2, max_tokens=24, tokens_per_step=150)
    lengths, docs = _data(7, 30, [70, 45, 1])
    return lengths, docs, topo, CostModel(attn_coef=1.0, linear_coef=20.0)


def _sampler(case, rank):
    from balancer.training import BalancedBatchSampler

    lengths, docs, topo, cost = _setup(case)
    n = len(lengths)
    if case == "pp":
        from megatron.core import parallel_state as ps

        return BalancedBatchSampler(
            lengths, topo, cost, dp_rank=ps.get_data_parallel_rank(), window_docs=n, overflow="split"
        ), docs
    return BalancedBatchSampler(lengths, topo, cost, rank=rank, window_docs=n, overflow="split"), docs


def _step_pieces(sampler, step):
    """Every (doc, start, end) of `step` over all ranks, each once (a CP group's ranks share a micro-batch)."""
    from balancer.training import Span

    out, seen = [], set()
    for rank in range(sampler.topology.pool_size):
        for m in range(sampler.step_micro_batches(step)):
            items = sampler.micro_batch(step, m, rank=rank)
            pieces = tuple((i.doc, i.start, i.end) if isinstance(i, Span) else (int(i), 0, None) for i in items)
            if (m, pieces) not in seen:
                seen.add((m, pieces))
                out += pieces
    return out


def _params(model) -> dict:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _sgd(params, grads, scale):
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= LR * g / scale


def _reference_worker(rank, world, cases, path):
    """Unpacked training of every case's plan (world of 1): per step the losses and the final parameters."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    result = {}
    for case in cases:
        lengths, docs, topo, cost = _setup(case)
        from balancer.training import BalancedBatchSampler

        sampler = BalancedBatchSampler(lengths, topo, cost, rank=0, window_docs=len(lengths), overflow="split")
        model = _gpt(ReferenceAttention)
        losses = []
        for step in range(STEPS):
            total = torch.zeros((), dtype=torch.float64)
            for d, a, b in _step_pieces(sampler, step):
                ids = docs[d][a:b]
                mask = torch.ones(len(ids), dtype=torch.float64)
                mask[-1] = 0
                labels = torch.cat([ids[1:], ids[:1]])
                logits = model(ids[None], torch.arange(len(ids))[None], None)[0]
                total = total + _token_losses(logits, labels, mask)
            n = sampler.step_loss_tokens(step)
            (total / n).backward()
            params = list(model.parameters())
            _sgd(params, [p.grad for p in params], 1.0)
            model.zero_grad()
            losses.append(float(total.detach()) / n)
        result[case] = {"losses": losses, "state": _params(model)}
    torch.save(result, path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("megatron_ref") / "ref.pt"
    run_world(1, _reference_worker, ("static", "dynamic", "pp"), str(path))
    return torch.load(path, weights_only=False)


def _train_worker(rank, world, case, path):
    """For each layout, `STEPS` steps of Megatron's schedule on this rank's `BalancedScheduler` from the same
    initial weights; saves the losses, the parameters and the CP group sizes the micro-batches ran on."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import balancer

    pp = 2 if case == "pp" else 1
    ps.initialize_model_parallel(1, pp, context_parallel_size=2 if case == "static" else 1)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    sampler, docs = _sampler(case, rank)
    groups = None if case == "pp" else balancer.cp_groups(sampler.topology)
    for layout, method in RUNS[case]:
        got = _train(sampler, docs, layout, method, groups, pp)
        if ps.get_data_parallel_rank() == 0 and (case != "static" or rank == 0):
            torch.save(got, f"{path}.{layout}-{method}.{got['stage']}")
    if case == "static":
        _check_sbhd_under_cp(docs)


def _check_sbhd_under_cp(docs):
    """Without packed params (sbhd, one sequence per row, sliced by Megatron's own `get_batch_on_this_cp_rank`)
    CPCoreAttention gives each CP rank the logits the THD path gives for the same sequence."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from balancer.integrations.megatron import CPCoreAttention, megatron_batch, packed_seq_params

    group = ps.get_context_parallel_group()
    r, cp = group.rank(), group.size()
    model = _gpt(CPCoreAttention)
    row = torch.cat(docs)[: 8 * cp]
    full = {"tokens": row[None].clone(), "position_ids": torch.arange(len(row))[None]}
    mine = get_batch_on_this_cp_rank(full, is_hybrid_cp=False, cp_group=group)
    sbhd = model(mine["tokens"], mine["position_ids"], None)
    b = megatron_batch([0], [row], cp_rank=r, cp_size=cp, layout="zigzag")
    assert torch.equal(b["tokens"], mine["tokens"])
    thd = model(b["tokens"], b["position_ids"], None, packed_seq_params=packed_seq_params(b, cp_group=group))
    assert (sbhd - thd).abs().max() <= 1e-12


def _train(sampler, docs, layout, method, groups, pp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from balancer.integrations.megatron import BalancedScheduler, CPCoreAttention

    sampler.set_epoch(0)
    sched = BalancedScheduler(sampler, docs, layout=layout, groups=groups)
    stage = ps.get_pipeline_model_parallel_rank()
    attention = CPCoreAttention.using(method)
    model = _gpt(attention, pre_process=stage == 0, post_process=stage == pp - 1, pp=pp, stage=stage)
    reduce_group = ps.get_data_parallel_group() if pp > 1 else None  # without PP: the whole DP x CP pool
    losses, sizes = [], set()
    for step in sched:
        iterator = _recording(step.data_iterator, sizes)
        with cuda_shims():
            out = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iterator, model=model,
                num_microbatches=step.num_microbatches, seq_length=1, micro_batch_size=1,
            )  # fmt: skip
        loss = torch.stack([o["loss"] for o in out]).sum() if out else torch.zeros((), dtype=torch.float64)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
        for g in grads + [loss]:
            dist.all_reduce(g, group=reduce_group)
        _sgd(list(model.parameters()), grads, step.loss_tokens)
        model.zero_grad()
        losses.append(float(loss) / step.loss_tokens)
        if step.step + 1 == STEPS:
            break
    return {"losses": losses, "state": _params(model), "stage": stage, "sizes": sorted(sizes)}


def _recording(iterator, sizes: set):
    for batch in iterator:
        sizes.add(batch["cp_size"])
        yield batch


def _stage_key(key, stage):
    """The full model's state-dict key of stage `stage`'s `key` (layers renumbered by the stage's offset)."""
    parts = key.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + stage * LAYERS // 2)
    return ".".join(parts)


def _check(reference, case, path, stages=1):
    ref = reference[case]
    for stage in range(stages):
        got = torch.load(f"{path}.{stage}", weights_only=False)
        if case == "dynamic":
            assert got["sizes"] == [1, 2, 4]
        elif case == "static":
            assert got["sizes"] == [2]
        if stage == stages - 1:  # the losses live on the last stage
            assert np.allclose(got["losses"], ref["losses"], rtol=0, atol=1e-9), (got["losses"], ref["losses"])
        assert len(got["state"]) > 4
        for key, value in got["state"].items():
            want = ref["state"][_stage_key(key, stage)]
            assert (value - want).abs().max() <= 1e-9, key
    assert ref["losses"][0] != ref["losses"][1]  # the steps trained


@pytest.mark.slow
def test_dp2_cp2_equals_unpacked_training(reference, tmp_path):
    """Every layout, each from the same initial weights, in one gloo world."""
    run_world(4, _train_worker, "static", str(tmp_path / "got"))
    for layout, method in RUNS["static"]:
        _check(reference, "static", tmp_path / f"got.{layout}-{method}")


@pytest.mark.slow
def test_dynamic_cp_equals_unpacked_training(reference, tmp_path):
    run_world(4, _train_worker, "dynamic", str(tmp_path / "got"))
    for layout, method in RUNS["dynamic"]:
        _check(reference, "dynamic", tmp_path / f"got.{layout}-{method}")


@pytest.mark.slow
def test_dp2_pp2_equals_unpacked_training(reference, tmp_path):
    run_world(4, _train_worker, "pp", str(tmp_path / "got"))
    _check(reference, "pp", tmp_path / "got.zigzag-ring", stages=2)
