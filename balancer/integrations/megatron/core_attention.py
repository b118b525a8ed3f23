"""`CPCoreAttention`: a Megatron core-attention module backed by `attention.cp_attention`.

Put it in a layer spec where Transformer Engine is absent (CPUs, GPUs without TE)::

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CPCoreAttention            # ring attention
    spec.submodules.self_attention.submodules.core_attention = CPCoreAttention.using("allgather")

Packed THD (``packed_seq_params.qkv_format == "thd"``): q/k/v arrive as ``[t, heads, head_dim]`` for this CP
rank's tokens; the layout of the row is ``packed_seq_params.cp_layout`` (set by
`balancer.integrations.megatron.packed_seq_params`) or, for a ``PackedSeqParams`` made elsewhere, Megatron's
per-document zigzag over ``cu_seqlens_q_padded``. The CP group is ``packed_seq_params.cp_group`` when set (dynamic
CP), else the module's ``pg_collection.cp``. Without packed params (sbhd ``[s, b, heads, head_dim]``), every batch
row is one sequence of ``s * cp`` tokens in Megatron's per-sequence zigzag. Causal or bidirectional by the mask
type, GQA, the config's sliding window; attention dropout and non-vanilla softmax are refused, never ignored.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from attention.cp import cp_attention
from attention.layout import CPLayout

CAUSAL = {AttnMaskType.causal: True, AttnMaskType.padding_causal: True, AttnMaskType.no_mask: False}


class CPCoreAttention(MegatronModule):
    """Exact packed CP attention for Megatron's ``SelfAttention`` (module docstring); ``method`` (class attribute):
    ``"ring"``, ``"allgather"`` or ``"ulysses"``, chosen with :meth:`using`."""

    method = "ring"
    backend = "auto"

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"CPCoreAttention computes exact attention: attention_dropout must be 0, got {dropout}")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"CPCoreAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
        if attn_mask_type not in CAUSAL:
            names = sorted(m.name for m in CAUSAL)
            raise ValueError(f"CPCoreAttention supports mask types {names}, got {attn_mask_type}")
        self.causal = CAUSAL[attn_mask_type]
        self.layer_number = max(1, layer_number)
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= self.layer_number
        window = config.window_size
        if window is not None and is_layer_window_attention(window, config.window_attn_skip_freq, layer_number):
            self.window_size = (int(window[0]), int(window[1]))
        else:
            self.window_size = (-1, -1)
        self.pg_collection = pg_collection

    @classmethod
    def using(cls, method: str = "ring", backend: str = "auto") -> type:
        """A subclass that runs `cp_attention` with ``method`` and ``backend`` (for a layer spec)."""
        from attention.cp import METHODS

        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        return type(f"CPCoreAttention_{method}", (cls,), {"method": method, "backend": backend})

    def _group(self, packed_seq_params):
        group = getattr(packed_seq_params, "cp_group", None)
        if group is None and self.pg_collection is not None:
            group = getattr(self.pg_collection, "cp", None)
        return group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """THD ``[t, h, d]`` -> ``[t, h*d]``; sbhd ``[s, b, h, d]`` -> ``[s, b, h*d]``."""
        if attention_bias is not None:
            raise ValueError("CPCoreAttention does not take an attention_bias")
        if attn_mask_type is not None and CAUSAL.get(attn_mask_type, None) != self.causal:
            raise ValueError(f"attn_mask_type {attn_mask_type} differs from the module's ({self.causal=})")
        group = self._group(packed_seq_params)
        size = 1 if group is None else group.size()
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            layout = thd_layout(packed_seq_params, size)
            out = self._attend(query, key, value, layout, group)
            return out.reshape(out.shape[0], -1)
        if packed_seq_params is not None:
            raise ValueError(f"CPCoreAttention takes qkv_format 'thd' or no packed params, got {packed_seq_params}")
        s, b = query.shape[:2]
        layout = _zigzag(tuple(range(0, (b + 1) * s * size, s * size)), size)
        q, k, v = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
        out = self._attend(q, k, v, layout, group)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _attend(self, q, k, v, layout: CPLayout, group) -> torch.Tensor:
        return cp_attention(
            q, k, v, layout, group=group, causal=self.causal, softmax_scale=self.softmax_scale,
            method=self.method, backend=self.backend, window_size=self.window_size,
        )  # fmt: skip


_LAST: dict = {}  # "thd": (packed_seq_params, layout), "sbhd": ((boundaries, cp), layout): the last one of each


def _zigzag(cu_seqlens: tuple, cp_size: int) -> CPLayout:
    """The per-document zigzag layout of every row of an sbhd batch, reused while the shape stays: every layer and
    every micro-batch of that shape use one object, so `cp_attention`'s agreement check across the group runs once.
    One entry only: every rank of a group sees the same sequence of calls, so all reuse or all rebuild together."""
    key = (cu_seqlens, cp_size)
    hit = _LAST.get("sbhd")
    if hit is None or hit[0] != key:
        hit = _LAST["sbhd"] = (key, CPLayout.build(np.asarray(cu_seqlens, dtype=np.int64), cp_size, kind="zigzag"))
    return hit[1]


def thd_layout(packed_seq_params: Any, cp_size: int) -> CPLayout:
    """The `CPLayout` of a THD micro-batch: the one `packed_seq_params` carries, else Megatron's per-document zigzag
    over ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``); its CP size must be the group's."""
    layout = getattr(packed_seq_params, "cp_layout", None)
    hit = _LAST.get("thd")
    if layout is None and hit is not None and hit[0] is packed_seq_params:  # the other layers of this micro-batch
        layout = hit[1]
    if layout is None:
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        cu = cu.detach().cpu().numpy().astype(np.int64)
        lens = np.diff(cu)
        if cp_size > 1 and (lens % (2 * cp_size)).any():
            raise ValueError(
                f"PackedSeqParams without a cp_layout are read as Megatron's per-document zigzag, which needs every "
                f"padded document length divisible by 2*cp = {2 * cp_size}; got lengths {lens.tolist()[:8]}..."
            )
        layout = CPLayout.build(cu, cp_size, kind="zigzag")
        _LAST["thd"] = (packed_seq_params, layout)
    if layout.cp_size != cp_size:
        raise ValueError(f"the batch is sharded for CP size {layout.cp_size} but the CP group has {cp_size} ranks")
    return layout
