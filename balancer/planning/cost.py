"""The cost model: how much work one document (and one micro-batch) is.

`cost(d) = attn_coef * pairs(d) + linear_coef * d`, with `pairs(d) = d*(d+1)/2` for causal attention and `d*d`
otherwise, plus `fixed` once per micro-batch. This module is the only owner of that formula: the planner, the
metrics, the benchmarks and the telemetry all call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


def attention_pairs(lengths: np.ndarray | Sequence[int], causal: bool = True) -> np.ndarray:
    """Number of (query, key) pairs attention computes for documents of the given lengths (float64)."""
    d = np.asarray(lengths, dtype=np.float64)
    return d * (d + 1.0) / 2.0 if causal else d * d


@dataclass(frozen=True)
class CostModel:
    """Per-document cost: `attn_coef * pairs(d) + linear_coef * d`; `fixed` is charged once per micro-batch.

    Units are whatever the coefficients are in (FLOPs for `from_model`, seconds for `fit`); only ratios matter
    to the planner.
    """

    attn_coef: float
    linear_coef: float
    fixed: float = 0.0
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("attn_coef", "linear_coef", "fixed"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}")
        if self.attn_coef == 0 and self.linear_coef == 0:
            raise ValueError("CostModel needs attn_coef > 0 or linear_coef > 0 (both are 0)")

    def cost(self, lengths: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """Vectorised per-document cost (float64 array of the input's shape; `fixed` not included)."""
        d = np.asarray(lengths, dtype=np.float64)
        return self.attn_coef * attention_pairs(d, self.causal) + self.linear_coef * d

    __call__ = cost

    def micro_batch_cost(self, lengths: np.ndarray | Sequence[int]) -> float:
        """Cost of one micro-batch holding documents of these lengths, `fixed` included."""
        return float(self.cost(lengths).sum() + self.fixed)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(**{k: data[k] for k in ("attn_coef", "linear_coef", "fixed", "causal") if k in data})

    @classmethod
    def from_model(
        cls,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        intermediate_size: int | None = None,
        vocab_size: int = 0,
        head_dim: int | None = None,
        gated_mlp: bool = True,
        causal: bool = True,
        fixed: float = 0.0,
    ) -> CostModel:
        """Analytic training FLOPs (forward + backward) of a decoder-only transformer, per document.

        - attention, per (query, key) pair: forward QK^T and PV are `2 * head_dim` FLOPs each per head, backward is
          twice the forward, so `attn_coef = 12 * num_layers * num_heads * head_dim`;
        - linear, per token: `6 * P_matmul` (2 forward + 4 backward per weight) where
          `P_matmul = num_layers * (hidden*(num_heads*head_dim) + 2*hidden*(num_kv_heads*head_dim)
          + (num_heads*head_dim)*hidden + k*hidden*intermediate) + hidden*vocab` with `k = 3` for a gated (SwiGLU)
          MLP and `k = 2` otherwise; the input embedding is a lookup, not a matmul, and norms/activations are ignored.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        intermediate_size = 4 * hidden_size if intermediate_size is None else intermediate_size
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; pass head_dim")
            head_dim = hidden_size // num_heads
        for name, value in dict(
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        ).items():
            if int(value) != value or value < 1:
                raise ValueError(f"CostModel.from_model: {name} must be a positive integer, got {value!r}")
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        mlp_mats = 3 if gated_mlp else 2
        per_layer = (
            hidden_size * q_dim
            + 2 * hidden_size * kv_dim
            + q_dim * hidden_size
            + mlp_mats * hidden_size * intermediate_size
        )
        matmul_params = num_layers * per_layer + hidden_size * vocab_size
        attn = 12.0 * num_layers * num_heads * head_dim
        return cls(attn_coef=float(attn), linear_coef=6.0 * float(matmul_params), fixed=float(fixed), causal=causal)

    @classmethod
    def from_config(cls, config: dict) -> CostModel:
        """`from_model` on a Hugging Face style config dict (`config.json` keys)."""

        def get(*names, default=None):
            for n in names:
                if n in config and config[n] is not None:
                    return config[n]
            return default

        hidden = get("hidden_size", "n_embd", "d_model")
        layers = get("num_hidden_layers", "n_layer", "num_layers")
        heads = get("num_attention_heads", "n_head", "num_heads")
        if hidden is None or layers is None or heads is None:
            raise ValueError("model config needs hidden_size, num_hidden_layers and num_attention_heads")
        return cls.from_model(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", default=heads),
            intermediate_size=get("intermediate_size", "n_inner", default=4 * hidden),
            vocab_size=get("vocab_size", default=0),
            head_dim=get("head_dim"),
            gated_mlp=get("hidden_act", default="silu") in ("silu", "swiglu", "geglu"),
        )

    @classmethod
    def fit(cls, lengths, seconds, causal: bool = True, fit_fixed: bool = True) -> CostModel:
        """Fit coefficients to measured timings with non-negative least squares (scipy.optimize.nnls).

        `lengths[i]` is either one document length or a sequence of document lengths that ran together as one
        measured micro-batch; `seconds[i]` is its measured time. With `fit_fixed` a per-micro-batch constant is
        fitted as well.
        """
        from scipy.optimize import nnls

        seconds = np.asarray(seconds, dtype=np.float64)
        if seconds.ndim != 1 or len(seconds) != len(lengths):
            raise ValueError(f"CostModel.fit: got {len(lengths)} samples of lengths but {seconds.shape} seconds")
        if len(seconds) < (3 if fit_fixed else 2):
            raise ValueError("CostModel.fit needs at least 3 timed samples (2 without fit_fixed)")
        if not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
            raise ValueError("CostModel.fit: seconds must be finite and >= 0")
        rows = []
        for i, item in enumerate(lengths):
            d = np.atleast_1d(np.asarray(item, dtype=np.float64))
            if d.size == 0 or np.any(d < 1):
                raise ValueError(f"CostModel.fit: sample {i} has an empty or non-positive length")
            rows.append((attention_pairs(d, causal).sum(), d.sum(), 1.0))
        a = np.array(rows)
        if not fit_fixed:
            a = a[:, :2]
        scale = a.max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(a / scale, seconds)
        coef = coef / scale
        fixed = float(coef[2]) if fit_fixed else 0.0
        if coef[0] == 0 and coef[1] == 0:
            raise ValueError("CostModel.fit: the timings fit no positive attention or linear coefficient")
        return cls(attn_coef=float(coef[0]), linear_coef=float(coef[1]), fixed=fixed, causal=causal)
