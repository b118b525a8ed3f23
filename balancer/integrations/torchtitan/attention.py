"""`PackedAttention`: an inner attention for torchtitan's models that attends within each packed document, on one
rank or split over a CP group, with the project's exact attention (`attention.varlen_attention`,
`attention.cp_attention`: ring, all-gather or Ulysses; PyTorch kernels on CPU, flash-attn on CUDA when installed).

torchtitan's own choices do not cover this: its varlen attention needs CUDA flash attention and refuses CP, its
flex attention has no backward on CPU, and its CP shards one sequence with torch's load balancers (documents a
multiple of 2 x CP). `use_packed_attention(model_config)` puts `PackedAttention` into every attention layer of a
torchtitan `Decoder.Config`; the model then reads the micro-batch's layout from the `attention_masks` that
`BalancedDataLoader` puts in its input dict (`PackedDocuments`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.protocols.module import Module

from balancer.integrations.torchtitan.batches import PackedDocuments


class PackedAttention(Module):
    """Causal attention inside each document of a packed micro-batch ([1, T_local] tokens), exact under CP.

    Config: `method` ("ring", "allgather", "ulysses": how K/V travel under CP), `backend` (the kernel: "auto",
    "torch", "flash", "reference"; `attention.BACKENDS`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        method: str = "allgather"
        backend: str = "auto"

    def __init__(self, config: Config) -> None:
        from attention.cp import METHODS

        super().__init__()
        if config.method not in METHODS:
            raise ValueError(f"PackedAttention.Config.method must be one of {METHODS}, got {config.method!r}")
        self.method, self.backend = config.method, config.backend

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: PackedDocuments,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """q `[1, T_local, N, H]`, k / v `[1, T_local, N_kv, H]` -> `[1, T_local, N, H]`; `enable_gqa` is implied
        by the head counts."""
        from attention.cp import cp_attention
        from attention.varlen import varlen_attention

        if not isinstance(attention_masks, PackedDocuments):
            raise TypeError(
                "PackedAttention needs the micro-batch's PackedDocuments as attention_masks (BalancedDataLoader puts "
                f"them in its input dict), got {type(attention_masks).__name__}"
            )
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"PackedAttention takes one packed sequence (batch size 1), got {q_BLNH.shape[0]}")
        if kwargs.get("score_mod") is not None or kwargs.get("out_transform") is not None:
            raise ValueError("PackedAttention does not implement score_mod / out_transform")
        q, k, v = q_BLNH[0], k_BLNH[0], v_BLNH[0]
        docs = attention_masks
        if docs.cp_size == 1:
            out = varlen_attention(q, k, v, docs.cu_seqlens, causal=True, softmax_scale=scale,
                                             backend=self.backend)  # fmt: skip
        else:
            out = cp_attention(q, k, v, docs.layout, group=docs.group, causal=True, softmax_scale=scale,
                                         method=self.method, backend=self.backend, rank=docs.cp_rank)  # fmt: skip
        return out[None]


def use_packed_attention(model_config: Any, method: str = "allgather", backend: str = "auto") -> Any:
    """`model_config` (a torchtitan `Decoder.Config`, e.g. `model_registry("debugmodel").model`) with every attention
    layer's `inner_attention` replaced by `PackedAttention.Config(method, backend)`; changed in place and returned."""
    layers = getattr(model_config, "layers", None)
    if not layers:
        raise TypeError(f"use_packed_attention takes a torchtitan Decoder.Config, got {type(model_config).__name__}")
    changed = 0
    for layer in layers:
        attn = getattr(layer, "attention", None)
        if attn is not None and hasattr(attn, "inner_attention"):
            attn.inner_attention = PackedAttention.Config(method=method, backend=backend)
            changed += 1
    if not changed:
        raise ValueError("the model config has no attention layer with an inner_attention to replace")
    return model_config


__all__ = ["PackedAttention", "use_packed_attention"]
