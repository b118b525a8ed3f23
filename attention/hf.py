"""Hugging Face transformers integration: run a stock model (e.g. ``LlamaForCausalLM``) with exact CP attention on
packed batches.

Usage (every rank of the CP group)::

    import attention, attention.hf
    attention.hf.register()                                   # once; name: attention.hf.NAME ("cp_attention")
    model = LlamaForCausalLM(config)                          # config._attn_implementation = attention.hf.NAME
    layout = attention.CPLayout.build(cu_seqlens, cp_size, kind="zigzag")
    ids = layout.shard(input_ids, rank)[None]                 # [1, T_local]: batch size 1, the packed batch
    pos = torch.from_numpy(layout.position_ids(rank))[None]   # position inside each document (RoPE)
    lab = layout.shard(shifted_labels, rank)[None]
    with attention.hf.cp_context(layout, group=cp_group, method="ring"):
        logits = model(input_ids=ids, position_ids=pos).logits
    loss = cross_entropy(logits[0], lab[0], ignore_index=-100, reduction="sum") / global_label_count

How inputs must be prepared:
  - the batch is one packed sequence (batch size 1) of whole documents with global ``cu_seqlens``; every rank
    passes its shard in ``layout.shard`` order;
  - ``position_ids`` must be the position of each token inside its document (``layout.position_ids(rank)``), not
    0..T_local-1: RoPE needs the true positions, and the attention itself takes the document structure from the
    layout, not from ``position_ids`` or an attention mask (leave ``attention_mask`` None: a mask of all ones is
    accepted, one with zeros, i.e. padding, or any 4-D mask raises ValueError; so does an unknown keyword argument,
    see :data:`IGNORED` for the ones accepted without effect);
  - labels must be shifted per document *before* sharding: ``shifted[t] = input_ids[t+1]`` inside a document and
    ``-100`` at each document's last token (the next token of a shard is usually on another rank, and a document's
    next token belongs to another document). Then compute the loss on the logits without any further shift (or pass
    ``labels=lab, shift_labels=lab`` to the model, which then skips its own shift; add
    ``num_items_in_batch=global_label_count`` to normalise by the step's global label count instead of the local
    one). Summing the per-rank losses and gradients (as data parallelism does) gives the full-batch values.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from attention.cp import cp_attention
from attention.layout import CPLayout
from attention.varlen import varlen_attention

NAME = "cp_attention"


@dataclass(frozen=True)
class _Ctx:
    layout: CPLayout
    group: Optional[dist.ProcessGroup]
    method: str
    backend: str
    head_chunks: int
    parent: Optional[_Ctx] = None  # the enclosing block: attention run in this block also ran in that one
    ran: list = field(default_factory=lambda: [False])  # [True] once attention ran inside the block


_CTX: contextvars.ContextVar[Optional[_Ctx]] = contextvars.ContextVar("cp_attention_ctx", default=None)


def _attn_implementation(model) -> Optional[str]:
    inner = getattr(model, "module", model)  # DDP / FSDP wrappers keep the model in .module
    config = getattr(inner, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


@contextlib.contextmanager
def cp_context(
    layout: CPLayout,
    group: Optional[dist.ProcessGroup] = None,
    method: str = "ring",
    backend: str = "auto",
    head_chunks: int = 1,
    model: Optional[torch.nn.Module] = None,
) -> Iterator[None]:
    """Inside this block, attention of models using ``attn_implementation=NAME`` runs :func:`attention.cp_attention`
    with this layout, process group (default WORLD), method and backend (with ``layout.cp_size == 1``:
    :func:`attention.varlen_attention`, no process group needed).

    A model still on another attention (sdpa, eager, flash) would ignore the layout and silently compute a wrong
    result, so: given ``model``, its attention implementation is checked up front (ValueError); in any case a block
    that ends without this attention having run raises RuntimeError."""
    if not isinstance(layout, CPLayout):
        raise TypeError(f"layout must be a CPLayout, got {type(layout).__name__}")
    if model is not None and _attn_implementation(model) != NAME:
        raise ValueError(
            f"the model's attention is {_attn_implementation(model)!r}, not {NAME!r}: it would ignore the CP layout. "
            f"Call attention.hf.register() and build the model with attn_implementation={NAME!r} "
            f"(or call model.set_attn_implementation({NAME!r}))"
        )
    ctx = _Ctx(layout, group, method, backend, head_chunks, parent=_CTX.get())
    token = _CTX.set(ctx)
    try:
        yield
    finally:
        _CTX.reset(token)
    if not ctx.ran[0]:
        raise RuntimeError(
            f"no attention ran through {NAME!r} inside cp_context: the model's attention is not the project's (it "
            f"ignored the CP layout, so its output is wrong). Call attention.hf.register() and build the model with "
            f"attn_implementation={NAME!r} (or model.set_attn_implementation({NAME!r})) before running it here"
        )


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[1, H, T_local, D]``, key/value ``[1, Hkv, T_local, D]`` ->
    (``[1, T_local, H, D]``, None)."""
    ctx = _CTX.get()
    if ctx is None:
        raise RuntimeError(
            f"attn_implementation={NAME!r} needs the CP layout: run the model inside "
            "`with attention.hf.cp_context(layout, group):`"
        )
    if query.shape[0] != 1:
        raise ValueError(f"CP attention takes one packed sequence (batch size 1), got batch size {query.shape[0]}")
    if dropout:
        raise ValueError("CP attention does not implement attention dropout; set attention_dropout=0")
    _check_attention_mask(attention_mask)
    _check_kwargs(kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not query.dtype == key.dtype == value.dtype:  # autocast hands mixed precisions (fp32 after RoPE, bf16 values)
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
        query, key, value = (x.to(dtype) for x in (query, key, value))
    window, softcap = _masks_from_kwargs(bool(causal), kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    outer: Optional[_Ctx] = ctx
    while outer is not None:
        outer.ran[0] = True
        outer = outer.parent
    if ctx.layout.cp_size == 1:  # one rank holds every token: packed attention, no process group involved
        cu = ctx.layout.local_cu_seqlens(0)
        out = varlen_attention(q, k, v, cu, bool(causal), scaling, ctx.backend, window_size=window, softcap=softcap)
        return out.unsqueeze(0), None
    out = cp_attention(
        q,
        k,
        v,
        ctx.layout,
        group=ctx.group,
        causal=bool(causal),
        softmax_scale=scaling,
        method=ctx.method,
        backend=ctx.backend,
        head_chunks=ctx.head_chunks,
        window_size=window,
        softcap=softcap,
    )
    return out.unsqueeze(0), None


# keyword arguments transformers may pass that change attention in ways cp_attention does not reproduce
_UNSUPPORTED = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "alibi_slopes": "ALiBi",
    "alibi": "ALiBi",
    "position_bias": "an additive position bias",
    "attention_bias": "an additive attention bias",
}
# keyword arguments cp_attention reads (besides query/key/value, attention_mask, dropout, scaling, is_causal)
_HONOURED = ("sliding_window", "softcap")
# keyword arguments that reach the attention function but do not change what it computes, with the reason
# (docs/attention.md lists them); anything else is refused rather than silently ignored
IGNORED = {
    "position_ids": "positions are applied by the model (RoPE) before attention; the layout holds the documents",
    "cu_seq_lens_q": "flash-attn packing boundaries; the CP layout holds the document boundaries",
    "cu_seq_lens_k": "flash-attn packing boundaries; the CP layout holds the document boundaries",
    "max_length_q": "flash-attn packing bound; the CP layout holds the document boundaries",
    "max_length_k": "flash-attn packing bound; the CP layout holds the document boundaries",
    "seq_idx": "packed-sequence index for state-space layers; the CP layout holds the document boundaries",
    "cache_position": "positions of new tokens in a KV cache; cp_attention checks K/V rows against the layout",
    "use_cache": "a model-level flag; cp_attention checks K/V rows against the layout",
    "output_hidden_states": "a model-level output flag",
    "output_router_logits": "a model-level output flag (MoE routers)",
    "num_items_in_batch": "a loss normaliser passed through the model",
    "labels": "loss inputs passed through the model",
    "shift_labels": "loss inputs passed through the model",
    "return_dict": "a model-level output flag",
}


def _check_attention_mask(attention_mask) -> None:
    """Refuse a mask cp_attention would not honour: any 4-D mask, or a 1-D/2-D padding mask with a zero (padding).
    A mask of all ones (no padding) adds nothing to the layout's document-causal mask and is accepted (the check
    reads the mask on the host: pass None to avoid it)."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() > 2:
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(
            f"CP attention takes the document and causal mask from the CP layout and cannot honour a custom "
            f"attention_mask {shape}; pass attention_mask=None"
        )
    if not bool(attention_mask.all()):
        raise ValueError(
            "attention_mask has zeros (padding or masked tokens), which CP attention cannot honour: the CP layout "
            "says which tokens attend to which; pack whole documents without padding and pass attention_mask=None"
        )


def _check_kwargs(kwargs: dict) -> None:
    if kwargs.get("output_attentions"):
        raise ValueError("CP attention does not materialise attention weights; set output_attentions=False")
    unknown = sorted(set(kwargs) - set(_UNSUPPORTED) - set(_HONOURED) - set(IGNORED) - {"output_attentions"})
    if unknown:
        raise ValueError(
            f"CP attention got keyword argument(s) {unknown} it does not know; it cannot tell whether they change "
            "the attention, so it refuses rather than ignore them (docs/attention.md lists the accepted ones)"
        )


def _masks_from_kwargs(causal: bool, kwargs: dict) -> tuple[tuple[int, int], float]:
    """(window_size, softcap) for cp_attention from a model's attention kwargs: ``sliding_window=w`` (keys within
    the last ``w`` positions, transformers' convention) -> ``(w - 1, -1)`` causal, ``(w - 1, w - 1)`` otherwise;
    ``softcap``. Raises ValueError for anything cp_attention would silently compute differently."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"CP attention cannot reproduce {what} (model passed {name!r}); use another attention")
    sliding = kwargs.get("sliding_window")
    window = (-1, -1)
    if sliding is not None:
        sliding = int(sliding)
        if sliding < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding}")
        window = (sliding - 1, -1 if causal else sliding - 1)
    softcap = kwargs.get("softcap")
    return window, float(softcap) if softcap else 0.0


def register(name: str = NAME) -> str:
    """Register :func:`cp_attention_forward` in transformers' ``AttentionInterface`` under ``name``; returns it."""
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(name, cp_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415
    except ImportError:  # older transformers hand the user's mask to the attention function as it is
        return name
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers mask function for :data:`NAME`: the model's 2-D padding mask, unchanged when it has a zero
    (:func:`cp_attention_forward` then refuses it), else None. Without it transformers drops the mask of an
    attention implementation it does not know, and padding would be silently ignored."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask
