"""The RL / DPO loss helpers, `step_counts` and the planning arguments refuse bad input with one ValueError naming
the argument (NaN, infinities, negative counts, floats where integers belong, shapes that do not match, a step the
plan does not have), instead of returning NaN, a silently wrong loss, or a torch IndexError / RuntimeError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import balancer
from balancer.training import loss as L

COST = balancer.CostModel(attn_coef=1e-4, linear_coef=1.0)
LENGTHS = np.array([10, 20, 30, 40, 5, 6, 7, 8])


@pytest.fixture(scope="module")
def plan():
    return balancer.balance_batch(
        LENGTHS, balancer.Topology(dp=2, micro_batches=2, max_tokens=64), COST, mini_batches=2
    )


def _refused(match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def test_step_counts_refuses_bad_steps_counts_and_groups(plan):
    _refused(r"step=2 does not exist: the plan has 2 steps", L.step_counts, plan, 2, LENGTHS)
    _refused(r"step=-1 does not exist", L.step_counts, plan, -1, LENGTHS)
    _refused(r"step must be an integer, got 0.5", L.step_counts, plan, 0.5, LENGTHS)
    _refused(r"step must be an integer, got True", L.step_counts, plan, True, LENGTHS)
    _refused(r"loss_tokens\[0\] = -10: document 0 has 10 tokens", L.step_counts, plan, 0, -LENGTHS)
    _refused(r"loss_tokens must hold integers, got dtype float64", L.step_counts, plan, 0, LENGTHS + 0.5)
    _refused(r"loss_tokens must hold integers", L.step_counts, plan, 0, np.full(8, np.nan))
    _refused(r"loss_tokens\[0\] = 11: document 0 has 10 tokens", L.step_counts, plan, 0, LENGTHS + 1)
    _refused(
        r"loss_tokens must hold one integer per document of the plan \(8\), got shape \(7,\)",
        L.step_counts,
        plan,
        0,
        LENGTHS[:7],
    )
    _refused(r"groups must hold integers", L.step_counts, plan, 0, LENGTHS, groups=np.arange(8) + 0.5)
    _refused(r"groups must hold one integer per document", L.step_counts, plan, 0, LENGTHS, groups=np.arange(7))
    counts = L.step_counts(plan, np.int64(1), torch.as_tensor(LENGTHS))  # NumPy / torch integers are fine
    assert counts.num_sequences == int((plan.step_of_entry() == 1).sum())


def test_rl_loss_refuses_shapes_foreign_documents_and_counts_of_another_step(plan):
    in_step = [int(d) for d in plan.doc[plan.step_of_entry() == 0]]
    other = next(d for d in range(8) if d not in in_step)
    counts = L.step_counts(plan, 0, LENGTHS)
    doc = torch.tensor([in_step[0]] * 3 + [in_step[1]] * 2)
    ones = torch.ones(5)
    assert torch.isfinite(L.rl_loss(ones, ones, doc, counts))
    _refused(
        r"per_token \(5,\), loss_mask \(4,\) and doc_ids \(5,\) must have one shape",
        L.rl_loss,
        ones,
        torch.ones(4),
        doc,
        counts,
    )
    _refused(
        r"doc_ids holds document 9, but the plan of counts has 8",
        L.rl_loss,
        ones,
        ones,
        torch.tensor([0, 0, 1, 1, 9]),
        counts,
    )
    for reduction in L.RL_REDUCTIONS:  # a token of a document of step 1 under step 0's counts
        _refused(
            rf"document {other} has loss tokens in this micro-batch, but counts .* does not count it",
            L.rl_loss,
            ones,
            ones,
            torch.tensor([in_step[0]] * 4 + [other]),
            counts,
            reduction,
        )
    few = L.step_counts(plan, 0, np.where(np.arange(8) == in_step[0], 2, LENGTHS))
    _refused(
        rf"loss_mask marks 3 loss tokens of document {in_step[0]} .* more than the 2", L.rl_loss, ones, ones, doc, few
    )
    _refused(r"counts must be the StepCounts", L.rl_loss, ones, ones, doc, {"num_tokens": 3})


def test_dpo_loss_refuses_bad_beta_pair_counts_cp_size_and_shapes():
    z = torch.zeros(3)
    assert torch.isfinite(L.dpo_loss(z, z, z, z, 0.1, 3))
    for beta, match in (
        (float("nan"), "beta must be a finite number"),
        (float("inf"), "beta must be a finite"),
        (-1.0, r"beta must be in \(0"),
        (0.0, r"beta must be in \(0"),
        ("0.1", "beta must be a number"),
    ):
        _refused(match, L.dpo_loss, z, z, z, z, beta, 3)
    _refused(r"num_pairs_global must be an integer, got 2.5", L.dpo_loss, z, z, z, z, 0.1, 2.5)
    _refused(r"num_pairs_global must be an integer, got nan", L.dpo_loss, z, z, z, z, 0.1, float("nan"))
    _refused(r"num_pairs_global=2 is below the 3 pairs of this micro-batch", L.dpo_loss, z, z, z, z, 0.1, 2)
    _refused(r"num_pairs_global must be in \[1,", L.dpo_loss, z, z, z, z, 0.1, 0)
    _refused(r"cp_size must be in \[1,", L.dpo_loss, z, z, z, z, 0.1, 3, cp_size=0)
    _refused(r"cp_size must be an integer, got 1.5", L.dpo_loss, z, z, z, z, 0.1, 3, cp_size=1.5)
    _refused(
        r"must be 1-D with one entry per pair, got shapes \(3,\), \(2,\)", L.dpo_loss, z, torch.zeros(2), z, z, 0.1, 3
    )


def test_sequence_and_token_helpers_refuse_ids_out_of_range_and_bad_normalisers():
    _refused(r"seq_ids holds 5, but num_sequences is 2", L.sequence_logps, torch.ones(4), torch.tensor([0, 1, 5, 0]), 2)
    _refused(
        r"token_logps \(4,\) and seq_ids \(3,\) do not match",
        L.sequence_logps,
        torch.ones(4),
        torch.tensor([0, 1, 0]),
        2,
    )
    _refused(r"num_sequences must be an integer", L.sequence_logps, torch.ones(2), torch.tensor([0, 1]), 2.5)
    _refused(r"seq_ids holds 3, but docs has 2", L.token_doc_ids, torch.tensor([0, 3]), [5, 6])
    logits, labels = torch.zeros(3, 5), torch.tensor([1, 2, 3])
    for n, match in (
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (2.5, "whole count"),
        (0, r"in \(0"),
        (-4, r"in \(0"),
    ):
        _refused(f"num_loss_tokens_global must be .*{match}", L.token_loss, logits, labels, n)
    assert torch.isclose(L.token_loss(logits, labels, 3.0), L.token_loss(logits, labels, torch.tensor(3)))
    _refused(
        r"labels holds token id 7, outside the logits' vocabulary of 5 ids",
        L.token_loss,
        logits,
        torch.tensor([1, 2, 7]),
        3,
    )
    _refused(r"labels holds token id -5", L.token_logprobs, logits, torch.tensor([1, -5, -100]))
    _refused(
        r"num_sequences_global must be an integer, got 1.5",
        L.token_loss,
        logits,
        labels,
        reduction="sequence",
        seq_ids=torch.tensor([0, 0, 1]),
        seq_loss_tokens=torch.tensor([2, 1]),
        num_sequences_global=1.5,
    )


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: balancer.Topology(dp=2, tokens_per_step=float("inf")), "Topology.tokens_per_step must be a positive"),
        (lambda: balancer.Topology(dp=2, tokens_per_step=float("nan")), "Topology.tokens_per_step must be a positive"),
        (lambda: balancer.Topology(dp=2, tokens_per_step="abc"), "Topology.tokens_per_step must be a positive"),
        (lambda: balancer.CostModel(True, 1.0), "CostModel.attn_coef must be a finite number"),
        (lambda: balancer.CostModel(1.0, 1.0, window=float("inf")), "CostModel.window must be a positive integer"),
        (
            lambda: balancer.CostModel.from_model(hidden_size=64, num_layers=2, num_heads=4, vocab_size=-5),
            r"from_model: vocab_size must be in \[0,",
        ),
        (
            lambda: balancer.CostModel.from_model(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=-5),
            r"from_model: intermediate_size must be in \[0,",
        ),
        (
            lambda: balancer.CostModel.from_model(hidden_size=64, num_layers=True, num_heads=4),
            "from_model: num_layers must be an integer, got True",
        ),
        (
            lambda: balancer.CostModel.from_model(hidden_size=64.5, num_layers=2, num_heads=4),
            "from_model: hidden_size must be an integer, got 64.5",
        ),
        (
            lambda: balancer.CostModel.from_model(
                hidden_size=64, num_layers=2, num_heads=4, hardware="h100-nvlink", dtype_bytes=0
            ),
            r"from_model: dtype_bytes must be in \[1,",
        ),
        (
            lambda: balancer.balance_batch(LENGTHS, balancer.Topology(dp=2, max_tokens=64), COST, pipeline_order="no"),
            "pipeline_order must be True or False",
        ),
    ],
)
def test_topology_cost_and_balance_batch_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_sampler_micro_batch_refuses_indices_out_of_range():
    """Before, `m` or `dp_rank` past the end silently returned another rank's micro-batch, and a float step was
    truncated."""
    lengths = np.random.default_rng(0).integers(10, 200, 300)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=512)
    sampler = balancer.BalancedBatchSampler(lengths, topo, COST, dp_rank=0, seed=0)
    assert sampler.micro_batch(np.int64(0), np.int64(1), dp_rank=np.int64(1))
    for args, kwargs, match in [
        ((0, 2), {}, r"m must be in \[0, 1\], got 2"),
        ((0, -1), {}, r"m must be in \[0, 1\], got -1"),
        ((0, 1.5), {}, "m must be an integer"),
        ((1.5, 0), {}, "step must be an integer, got 1.5"),
        ((True, 0), {}, "step must be an integer, got True"),
        ((0, 0), {"dp_rank": 2}, r"dp_rank must be in \[0, 1\], got 2"),
        ((0, 0), {"rank": 9}, r"rank must be in \[0, 1\], got 9"),
    ]:
        with pytest.raises(ValueError, match=match):
            sampler.micro_batch(*args, **kwargs)
