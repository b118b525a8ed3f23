import numpy as np
import pytest

from attention.geometry import attention_pairs
from balancer import CostModel, Topology


def test_pairs_and_cost_formula():
    d = np.array([1, 2, 10])
    assert attention_pairs(d).tolist() == [1, 3, 55]
    assert attention_pairs(d, causal=False).tolist() == [1, 4, 100]
    c = CostModel(attn_coef=2.0, linear_coef=3.0, fixed=5.0)
    assert c.cost(d).tolist() == [2 + 3, 6 + 6, 110 + 30]
    assert c.micro_batch_cost([1, 2]) == 5 + 12 + 5


def test_from_model_matches_hand_count():
    # 2 layers, hidden 8, 2 heads of 4, 1 kv head, MLP 16 (gated), vocab 10
    c = CostModel.from_model(
        hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=10
    )
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16
    assert c.linear_coef == 6 * (2 * per_layer + 8 * 10)
    assert c.attn_coef == 12 * 2 * 2 * 4


def test_from_config_llama_keys():
    cfg = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "hidden_act": "silu",
    }
    assert CostModel.from_config(cfg) == CostModel.from_model(64, 2, 4, 2, 128, 100)
    with pytest.raises(ValueError, match="hidden_size"):
        CostModel.from_config({"vocab_size": 3})


def test_fit_recovers_coefficients():
    rng = np.random.default_rng(0)
    true = CostModel(attn_coef=3e-9, linear_coef=2e-6, fixed=1e-3)
    samples = [rng.integers(1, 20000, rng.integers(1, 6)) for _ in range(60)]
    seconds = np.array([true.micro_batch_cost(s) for s in samples]) * (1 + 0.001 * rng.standard_normal(60))
    fit = CostModel.fit(samples, seconds)
    assert fit.attn_coef == pytest.approx(true.attn_coef, rel=0.02)
    assert fit.linear_coef == pytest.approx(true.linear_coef, rel=0.02)
    assert fit.fixed == pytest.approx(true.fixed, rel=0.1)
    with pytest.raises(ValueError, match="samples"):
        CostModel.fit([[1]], [1.0, 2.0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attn_coef=-1, linear_coef=1), "attn_coef"),
        (dict(attn_coef=0, linear_coef=0), "attn_coef > 0"),
        (dict(attn_coef=float("nan"), linear_coef=1), "finite"),
    ],
)
def test_cost_model_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)


def test_topology_defaults_and_validation():
    t = Topology(dp=2, cp=2, micro_batches=3, max_tokens=100)
    assert t.capacity == 1200 and t.micro_batch_tokens == 200 and t.tokens_per_step == 1020
    with pytest.raises(ValueError, match="exceeds the capacity"):
        Topology(dp=1, max_tokens=10, tokens_per_step=11)
    with pytest.raises(ValueError, match="dp must be >= 1"):
        Topology(dp=0)
    with pytest.raises(ValueError, match="integer"):
        Topology(dp=1.5)
    with pytest.raises(ValueError, match="tokens_per_step"):
        Topology(dp=1, tokens_per_step=0)
