"""The cost model a torchtitan loader plans with: a saved one (`balancer calibrate`), explicit coefficients, the
analytic model of a torchtitan model config (`cost_for`), or, when none is given, that of Llama 3 8B."""

from __future__ import annotations

import logging
from typing import Any, Optional

from balancer.planning.cost.model import CostModel

logger = logging.getLogger(__name__)

# Llama 3 8B: the analytic default (its attention / linear balance is what the planner needs, not the scale)
DEFAULT_SHAPE: dict[str, Any] = dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                     intermediate_size=14336, vocab_size=128256)  # fmt: skip


def cost_for(model_config: Any) -> dict:
    """`CostModel.from_model(...)` of a torchtitan `Decoder.Config` (dim, layers, heads, KV heads, feed-forward width,
    vocabulary), as the dict `BalancedDataLoader.Config.cost` takes."""
    layers = [layer for layer in model_config.layers if getattr(layer, "attention", None) is not None]
    if not layers:
        raise ValueError("the model config has no attention layer: no analytic cost model for it")
    attn = layers[0].attention
    ffn = getattr(layers[0], "feed_forward", None)
    width = getattr(getattr(ffn, "w1", None), "out_features", None)
    return CostModel.from_model(
        hidden_size=model_config.dim,
        num_layers=len(model_config.layers),
        num_heads=attn.n_heads,
        num_kv_heads=attn.n_kv_heads or attn.n_heads,
        intermediate_size=width,
        vocab_size=model_config.vocab_size,
    ).to_dict()


def resolve_cost(cost: dict, cost_path: Optional[str]) -> CostModel:
    """`cost_path` (a saved model), else `cost` (a `CostModel.to_dict()`, e.g. `cost_for(...)`), else the default."""
    if cost_path and cost:
        raise ValueError("BalancedDataLoader.Config: give cost_path or cost, not both")
    if cost_path:
        return CostModel.load(cost_path)
    if cost:
        unknown = sorted(set(cost) - set(CostModel.__dataclass_fields__))
        if unknown:
            raise ValueError(f"BalancedDataLoader.Config.cost: unknown keys {unknown} (a CostModel.to_dict())")
        return CostModel.from_dict(cost)
    logger.info("BalancedDataLoader: no cost model given: the analytic model of Llama 3 8B (%s)", DEFAULT_SHAPE)
    return CostModel.from_model(**DEFAULT_SHAPE)
