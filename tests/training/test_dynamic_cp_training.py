"""Dynamic CP training equals plain unpacked training.

A pool of dp2 x cp2 = 4 gloo ranks with CP group sizes (1, 2, 4): in every micro-batch slot the ranks regroup (the
plan is asserted to use groups of one rank and groups of several ranks, and to change the partition between slots).
Each rank runs the balanced sampler for its pool rank, the dataset wrapped in SpanDataset (the group travels in the
indices), PackedCollator (shards for the batch's group), and a stock transformers Llama through attention.hf with
`group=groups[batch["cp_group_key"]]`; gradients are accumulated over the slots and summed over the pool. One
optimizer step: the loss and every gradient equal single-process unpacked training (fp64) to 1e-9.
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
TOL = 1e-9
CFG = dict(n_docs=18, seed=2, M=2, max_tokens=48, tokens_per_step=340)


def _model(attn: str):
    return tiny_llama(attn).double()  # float64: the equivalence is checked to 1e-9


def _setup():
    from balancer import CostModel, Topology
    from balancer.planning.dynamic import plan as dynamic

    dynamic.SPLIT_SLACK = 0.5  # a tiny plan: let the planner cut groups freely so that every size is exercised

    rng = np.random.default_rng(CFG["seed"])
    lengths = np.concatenate([[90, 70, 1, 2], rng.integers(3, 20, CFG["n_docs"] - 4)])
    g = torch.Generator().manual_seed(CFG["seed"])
    dataset = [{"input_ids": torch.randint(0, VOCAB, (int(n),), generator=g)} for n in lengths]
    topo = Topology(
        dp=2,
        cp=2,
        micro_batches=CFG["M"],
        max_tokens=CFG["max_tokens"],
        tokens_per_step=CFG["tokens_per_step"],
        cp_sizes=(1, 2, 4),
    )
    return lengths, dataset, topo, CostModel(attn_coef=1.0, linear_coef=20.0)


def _worker(rank, world, out_path):
    import attention.hf as ahf
    import balancer
    from balancer.training.loss import token_loss

    lengths, dataset, topo, cost = _setup()
    groups = balancer.cp_groups(topo)
    sampler = balancer.BalancedBatchSampler(lengths, topo, cost, rank=rank, seed=CFG["seed"], dataset=dataset)
    loader = torch.utils.data.DataLoader(
        balancer.SpanDataset(dataset), batch_sampler=sampler, collate_fn=balancer.PackedCollator()
    )
    ahf.register()
    model = _model(ahf.NAME)
    keys, loss = [], torch.zeros(1, dtype=torch.float64)
    for i, batch in enumerate(loader):
        step, m = sampler.step_of(i)
        assert step == 0 and batch["cp_group_key"] == tuple(sampler.cp_group(step, m))[:2]
        keys.append(batch["cp_group_key"])
        with ahf.cp_context(batch["layout"], group=groups[batch["cp_group_key"]], method="ring"):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        part = token_loss(logits, batch["labels"], sampler.step_loss_tokens(step))
        part.backward()
        loss += part.detach()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss])
    dist.all_reduce(flat)  # the loss is globally normalised: sum over the pool
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()
    if rank == 0:
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.save({"keys": keys, "grads": grads, "loss": float(flat[-1])}, out_path)


def _reference():
    import balancer

    lengths, dataset, topo, cost = _setup()
    plan = balancer.plan(lengths, topo, cost, seed=CFG["seed"])
    model = _model("sdpa")
    total, count = 0.0, 0
    for d in range(len(lengths)):
        ids = dataset[d]["input_ids"]
        logits = model(input_ids=ids[None]).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        count += len(ids) - 1
    (total / count).backward()
    return plan, float(total / count), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_dynamic_cp_training_equals_unpacked(tmp_path):
    plan, ref_loss, ref = _reference()
    assert plan.num_steps == 1  # one step, gradient accumulation over its slots
    sizes_per_slot = [sorted(g.ranks[1] for g in slot.groups) for slot in plan.steps[0].slots]
    assert any(1 in s for s in sizes_per_slot) and any(max(s) > 1 for s in sizes_per_slot), sizes_per_slot
    assert len({tuple(s) for s in sizes_per_slot}) > 1, "the partition never changes"
    out = tmp_path / "grads.pt"
    run_world(4, _worker, str(out))
    got = torch.load(out)
    assert [k for k, _ in plan.pool_view(0)[0]] == got["keys"]
    assert abs(got["loss"] - ref_loss) <= TOL * abs(ref_loss), (got["loss"], ref_loss)
    for n, gr in ref.items():
        err = float((got["grads"][n] - gr).abs().max())
        scale = max(float(gr.abs().max()), 1e-300)
        assert err <= TOL * scale, f"{n}: max abs error {err:.3e} vs scale {scale:.3e}"
