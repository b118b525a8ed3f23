"""RL and preference losses on a fixed batch: packed, balanced training on 2 gloo ranks equals the unpacked reference.

A stock transformers LlamaForCausalLM (tiny config, float64). The batch: 6 prompts x 4 responses (GRPO: advantages
normalised per prompt) and 12 preference pairs (DPO). `balance_batch` plans it over dp=2 ranks (every reduction and
DPO) or over one CP group of 2 ranks (per-group RL and DPO, sequence sums all-reduced over the CP group), 2
mini-batches, with prompts kept on a rank (RL) or pairs kept in a micro-batch (DPO). Each rank runs its
micro-batches through PackedCollator and the project's attention, weighs the loss with `rl_loss` / `dpo_loss` and
the plan's counts (`step_counts`), and the gradients are summed over the ranks. The reference computes every
mini-batch's loss one document at a time, with the plain definition of each reduction. Gradients agree to 1e-9
relative, every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.dist import run_world  # noqa: E402
from support.trainer import VOCAB, tiny_llama  # noqa: E402

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # multi-process gloo training

TOL = 1e-9
BETA = 0.3
REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "group-mean-token-mean")


def _batch(seed: int = 0):
    """24 documents in 6 groups of 4 (responses to one prompt; for DPO: pairs 2i, 2i+1), loss on the responses."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 31, 24)
    prompt = np.array([int(rng.integers(1, n - 1)) for n in lengths])
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in lengths]
    labels = [torch.cat([torch.full((int(p),), -100), x[int(p) :]]) for x, p in zip(ids, prompt)]
    groups = np.repeat(np.arange(6), 4)
    reward = rng.normal(size=24)
    mean = np.repeat(reward.reshape(6, 4).mean(axis=1), 4)
    std = np.repeat(reward.reshape(6, 4).std(axis=1), 4)
    advantage = torch.tensor((reward - mean) / (std + 1e-6), dtype=torch.float64)
    ref_logps = torch.tensor(rng.normal(-40, 5, 24), dtype=torch.float64)
    loss_tokens = np.array([int((lab[1:] != -100).sum()) for lab in labels])
    return lengths, ids, labels, groups, advantage, ref_logps, loss_tokens


def _plans(cp: int = 1):
    import balancer

    lengths, *_ = _batch()
    topo = balancer.Topology(dp=2 // cp, cp=cp, micro_batches=2, max_tokens=128 // cp)
    cost = balancer.CostModel(attn_coef=1.0, linear_coef=10.0)
    groups = np.repeat(np.arange(6), 4)
    pairs = np.repeat(np.arange(12), 2)
    rl = balancer.balance_batch(lengths, topo, cost, groups=groups, keep="rank", mini_batches=2, micro_batches="auto")
    dpo = balancer.balance_batch(lengths, topo, cost, groups=pairs, keep="micro_batch", mini_batches=2)
    return rl, dpo


def _micro_loss(case, model, batch, docs, counts, data, cp_group=None):
    import attention.hf as ahf
    from balancer.training.loss import dpo_loss, rl_loss, sequence_logps, token_doc_ids, token_logprobs

    _, _, _, _, advantage, ref_logps, _ = data
    with ahf.cp_context(batch["layout"], group=cp_group, method="ring", model=model):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    logps = token_logprobs(logits, batch["labels"])
    if case == "dpo":
        seq = sequence_logps(logps, batch["seq_ids"], len(docs), cp_group=cp_group)
        where = {d: i for i, d in enumerate(docs)}
        chosen = [d for d in docs if d % 2 == 0]
        c, r = [where[d] for d in chosen], [where[d + 1] for d in chosen]
        ref_c, ref_r = ref_logps[chosen], ref_logps[[d + 1 for d in chosen]]
        return dpo_loss(seq[c], seq[r], ref_c, ref_r, BETA, counts.num_groups, cp_size=batch["cp_size"])
    doc_ids = token_doc_ids(batch["seq_ids"], docs)
    ratio = torch.exp(logps - logps.detach())  # PPO's ratio at the sampling policy: gradient of log-prob
    per_token = -advantage[doc_ids.clamp(min=0)] * ratio
    return rl_loss(per_token, batch["labels"] != -100, doc_ids, counts, case)


def _worker(rank, world, cp, cases, out_path):
    import attention.hf as ahf
    from balancer.training.collate import PackedCollator
    from balancer.training.loss import step_counts

    data = _batch()
    lengths, ids, labels, groups, _, _, loss_tokens = data
    ahf.register()
    model = tiny_llama(ahf.NAME).double()
    dp_rank, cp_rank = divmod(rank, cp)
    collate = PackedCollator(cp_rank=cp_rank, cp_size=cp, dp_rank=dp_rank)
    cp_group = dist.group.WORLD if cp > 1 else None  # 2 processes: dp2 x cp1, or one CP group of 2
    rl, dpo = _plans(cp)
    results = {}
    for case in cases:
        plan = dpo if case == "dpo" else rl
        kept = np.repeat(np.arange(12), 2) if case == "dpo" else groups
        for step, micro_batches in enumerate(plan.rank_view(dp_rank)):
            counts = step_counts(plan, step, loss_tokens, kept)
            model.zero_grad(set_to_none=False)
            for docs in micro_batches:
                batch = collate([{"input_ids": ids[d], "labels": labels[d]} for d in docs])
                _micro_loss(case, model, batch, docs, counts, data, cp_group).backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(grads)  # SUM over the DP x CP ranks: every normaliser is already global
            results[(case, step)] = grads
    if rank == 0:
        torch.save(results, out_path)


def _reference(case, docs, data, model):
    """The step's loss as written in the definition, one document at a time, unpacked."""
    lengths, ids, labels, groups, advantage, ref_logps, _ = data
    token_loss, seq_logp, n_tok = {}, {}, {}
    for d in docs:
        logits = model(input_ids=ids[d][None]).logits[0, :-1]
        target = labels[d][1:]
        mask = target != -100
        logp = torch.gather(logits.log_softmax(-1), -1, target.clamp(min=0)[:, None])[:, 0][mask]
        token_loss[d] = -advantage[d] * torch.exp(logp - logp.detach())
        seq_logp[d] = logp.sum()
        n_tok[d] = int(mask.sum())
    if case == "token-mean":
        return sum(token_loss[d].sum() for d in docs) / sum(n_tok.values())
    if case == "seq-mean-token-mean":
        return sum(token_loss[d].sum() / n_tok[d] for d in docs) / len(docs)
    if case == "seq-mean-token-sum":
        return sum(token_loss[d].sum() for d in docs) / len(docs)
    if case == "group-mean-token-mean":
        per_group = {}
        for d in docs:
            per_group.setdefault(int(groups[d]), []).append(d)
        means = [sum(token_loss[d].sum() for d in m) / sum(n_tok[d] for d in m) for m in per_group.values()]
        return sum(means) / len(means)
    chosen = [d for d in docs if d % 2 == 0]
    margins = [BETA * ((seq_logp[c] - ref_logps[c]) - (seq_logp[c + 1] - ref_logps[c + 1])) for c in chosen]
    return sum(-torch.nn.functional.logsigmoid(m) for m in margins) / len(chosen)


CONFIGS = {  # 2 gloo processes: two DP ranks, or one replica of CP size 2 (documents split over the ranks)
    "dp2": (1, (*REDUCTIONS, "dpo")),
    "cp2": (2, ("group-mean-token-mean", "dpo")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rl_and_preference_losses_equal_unpacked(name, tmp_path):
    cp, cases = CONFIGS[name]
    data = _batch()
    rl, dpo = _plans(cp)
    assert rl.num_steps == dpo.num_steps == 2
    if cp == 1:
        assert (rl.micro_batch_tokens().sum(axis=2)[:, 0] != rl.micro_batch_tokens().sum(axis=2)[:, 1]).any()
    out = tmp_path / "grads.pt"
    run_world(2, _worker, cp, cases, str(out))
    got = torch.load(out)
    model = tiny_llama("sdpa").double()
    for case in cases:
        plan = dpo if case == "dpo" else rl
        for step in range(plan.num_steps):
            docs = sorted(int(d) for d in plan.doc[plan.step_of_entry() == step])
            model.zero_grad(set_to_none=False)
            _reference(case, docs, data, model).backward()
            want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            err = float((got[(case, step)] - want).abs().max())
            scale = float(want.abs().max())
            assert scale > 0 and err <= TOL * scale, f"{case} step {step}: max abs error {err:.3e} vs {scale:.3e}"
