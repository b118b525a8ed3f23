"""THE PROOF: packed, planned, context-parallel training with the toolkit equals plain unpacked training.

A stock transformers LlamaForCausalLM (tiny config, random weights, float64, no download). For every optimizer step
of an epoch:
  (a) reference, one process: the step's documents one at a time, plain mean token loss over all of the step's loss
      tokens, backward, SGD update;
  (b) dp x cp gloo ranks (spawned processes, CP groups via dist.new_group): BalancedBatchSampler + PackedCollator in
      a real DataLoader, gradient accumulation over micro_batches, CP attention through attention.hf, the toolkit's
      loss normalised by the plan's global loss-token count, gradients summed over the DP x CP world, SGD update.
Loss and every parameter's gradient agree to <= 1e-9 relative, at every step (so the updated weights agree too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.dist import run_world  # noqa: E402
from support.trainer import tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process gloo training

transformers = pytest.importorskip("transformers")

VOCAB = 64
LR = 0.5
TOL = 1e-9


def _model(attn: str):
    return tiny_llama(attn).double()  # float64: the equivalence is checked to 1e-9


def _data(n_docs: int, seed: int):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 2, 3, 40], rng.integers(1, 41, n_docs - 4)])  # 1-token docs: no loss token
    rng.shuffle(lengths)
    g = torch.Generator().manual_seed(seed)
    return lengths, [{"input_ids": torch.randint(0, VOCAB, (int(n),), generator=g)} for n in lengths]


def _setup(cfg):
    from balancer.planning.cost.model import CostModel
    from balancer.planning.topology import Topology
    from balancer.training.sampler import BalancedBatchSampler

    lengths, dataset = _data(cfg["n_docs"], cfg["seed"])
    topo = Topology(
        dp=cfg["dp"],
        cp=cfg["cp"],
        micro_batches=cfg["M"],
        max_tokens=cfg["max_tokens"],
        tokens_per_step=cfg["tokens_per_step"],
    )
    cost = CostModel(attn_coef=1.0, linear_coef=20.0)
    return lengths, dataset, topo, cost, BalancedBatchSampler


def _worker(rank, world, cfg, out_path):
    import attention.hf as ahf
    from balancer.training.collate import PackedCollator
    from balancer.training.loss import token_loss

    lengths, dataset, topo, cost, Sampler = _setup(cfg)
    dp_rank, cp_rank = divmod(rank, topo.cp)
    groups = [dist.new_group([d * topo.cp + c for c in range(topo.cp)]) for d in range(topo.dp)]
    cp_group = groups[dp_rank]
    # dp_rank from torch.distributed (rank // (cp*pp)) in one configuration, explicit in the others
    sampler = Sampler(
        lengths, topo, cost, dp_rank=None if cfg.get("auto_rank") else dp_rank, seed=cfg["seed"], dataset=dataset
    )
    assert sampler.dp_rank == dp_rank
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=PackedCollator(cp_rank=cp_rank, cp_size=topo.cp, layout=cfg.get("layout", "zigzag")),
    )
    ahf.register()
    model = _model(ahf.NAME)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    records, loss_acc, mixed = [], 0.0, 0
    for i, batch in enumerate(loader):
        step, m = sampler.step_of(i)
        split = batch["layout"].split_docs
        mixed += bool(split.any() and not split.all())  # micro-batches with both split and whole documents
        with ahf.cp_context(batch["layout"], group=cp_group, method=cfg["method"]):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = token_loss(logits, batch["labels"], sampler.step_loss_tokens(step))
        loss.backward()
        loss_acc += float(loss.detach())
        if m == topo.micro_batches - 1:
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([loss_acc], dtype=torch.float64)])
            dist.all_reduce(flat)  # sum over DP x CP (the loss is globally normalised)
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
            records.append({"loss": float(flat[-1]), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
            opt.step()
            opt.zero_grad(set_to_none=False)
            loss_acc = 0.0
    assert len(records) == sampler.num_steps
    if cfg.get("layout"):
        assert mixed >= 1, "the hybrid case must mix split and whole documents"
    if rank == 0:
        torch.save(records, out_path)


def _reference(cfg):
    """Unpacked, single process, one document at a time, plain mean token loss of each step."""
    lengths, dataset, topo, cost, Sampler = _setup(cfg)
    samplers = [Sampler(lengths, topo, cost, dp_rank=r, seed=cfg["seed"]) for r in range(topo.dp)]
    model = _model("sdpa")  # eager softmax runs in float32
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out, step_docs = [], []
    for step in range(samplers[0].num_steps):
        docs = [d for s in samplers for m in range(topo.micro_batches) for d in s.micro_batch(step, m)]
        step_docs.append(docs)
        total, count = 0.0, 0
        for d in docs:
            ids = dataset[d]["input_ids"]
            logits = model(input_ids=ids[None]).logits[0]
            total = total + torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")
            count += len(ids) - 1
        assert count == samplers[0].step_loss_tokens(step)
        loss = total / count
        loss.backward()
        out.append({"loss": float(loss.detach()), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad(set_to_none=False)
    return out, step_docs, samplers


CONFIGS = {
    "dp2xcp2-ring": dict(
        dp=2, cp=2, M=2, method="ring", max_tokens=48, tokens_per_step=260, n_docs=30, seed=3, auto_rank=True
    ),
    "dp2xcp2-allgather": dict(
        dp=2, cp=2, M=3, method="allgather", max_tokens=40, tokens_per_step=300, n_docs=26, seed=5
    ),
    # hybrid: documents over 12 tokens split, shorter ones whole on one CP rank
    "dp2xcp2-hybrid-ring": dict(
        dp=2,
        cp=2,
        M=2,
        method="ring",
        max_tokens=60,
        tokens_per_step=200,
        n_docs=16,
        seed=24,
        layout={"kind": "hybrid", "split_threshold": 12},
    ),
    "dp2xcp1": dict(dp=2, cp=1, M=2, method="ring", max_tokens=80, tokens_per_step=240, n_docs=24, seed=7),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_cp_training_equals_unpacked(name, tmp_path):
    cfg = CONFIGS[name]
    ref, step_docs, samplers = _reference(cfg)
    topo = samplers[0].topology
    # the plan really is a multi-step, gradient-accumulating, uneven one
    assert len(ref) >= 2
    assert sorted(d for docs in step_docs for d in docs) == list(range(cfg["n_docs"]))
    tok = samplers[0].plan.micro_batch_tokens()  # [steps, dp, M]
    assert (tok.sum(axis=2).max(axis=1) != tok.sum(axis=2).min(axis=1)).any(), "token counts per rank are even"
    out = tmp_path / "grads.pt"
    run_world(topo.dp * topo.cp, _worker, cfg, str(out))
    got = torch.load(out)
    assert len(got) == len(ref)
    for s, (a, b) in enumerate(zip(got, ref)):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]), (s, a["loss"], b["loss"])
        for n, gr in b["grads"].items():
            err = float((a["grads"][n] - gr).abs().max())
            scale = max(float(gr.abs().max()), 1e-300)
            assert err <= TOL * scale, f"step {s} {n}: max abs error {err:.3e} vs scale {scale:.3e}"
