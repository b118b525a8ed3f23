"""PyTorch's built-in flash-attention varlen kernel on CUDA (``aten._flash_attention_forward/backward``), bound by
the op schemas' argument names (:class:`attention.backends.binding.ArgAdapter`): windows where the schema has
``window_size_left/right`` (PyTorch 2.5 on; 2.13's schema is recorded in the tests), no softcap, the philox
arguments under either spelling (``rng_state``/``unused`` or ``philox_seed``/``philox_offset``), never read with
dropout 0. A schema with an argument the project cannot fill makes the backend refuse when it is built."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

import torch

from attention.backends.binding import ArgAdapter
from attention.backends.varlen_cuda import VarlenCUDABackend

log = logging.getLogger(__name__)

_ALIASES = {"rng_state": ("rng_state", "philox_seed"), "unused": ("unused", "philox_offset")}
_FWD = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
        "return_debug_mask", "scale")  # fmt: skip
_BWD = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "rng_state", "unused", "scale")  # fmt: skip


def schema_params(op: Any) -> dict:
    """inspect.Parameter objects for an op's schema (an OpOverloadPacket or OpOverload); {} if unreadable."""
    try:
        args = getattr(op, "default", op)._schema.arguments
    except Exception:  # noqa: BLE001 - an op without a readable schema is refused, not an error here
        return {}
    out = {}
    for a in args:
        default = None if a.has_default_value() else inspect.Parameter.empty  # every argument is passed by name
        out[a.name] = inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY, default=default)
    return out


class TorchCUDABackend(VarlenCUDABackend):
    """PyTorch's flash varlen kernel; ``ops`` = (forward op, backward op) may be given (tests pass stand-ins with
    recorded schemas), else ``torch.ops.aten._flash_attention_forward/backward``."""

    name = "torch"
    swaps_gqa = True

    def __init__(self, ops: Optional[tuple] = None) -> None:
        self.given = ops is not None
        fwd, bwd = ops if ops is not None else (torch.ops.aten._flash_attention_forward,
                                                torch.ops.aten._flash_attention_backward)  # fmt: skip
        self._fwd_op, self._bwd_op = fwd, bwd
        self.fwd_adapter = ArgAdapter(schema_params(fwd), _FWD, _FWD, _ALIASES)
        self.bwd_adapter = ArgAdapter(schema_params(bwd), _BWD, _BWD, _ALIASES)
        bad = self.fwd_adapter.error or self.bwd_adapter.error
        self.problem = f"torch: unsupported flash op schema ({bad})" if bad else ""
        self.has_window = not bad and self.fwd_adapter.window_style == "pair" == self.bwd_adapter.window_style
        self.has_softcap = False
        self.installed = True
        self.version = f"torch {torch.__version__}"
        if bad and torch.cuda.is_available():
            log.warning("attention backend torch (CUDA flash op) is unusable: %s", self.problem)

    def available(self) -> bool:
        if self.problem:
            return False
        return self.given or torch.backends.cuda.is_flash_attention_available()

    def why_not(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> str:
        if self.problem:
            return self.problem
        if q.is_cuda and not self.available():
            return self.device_problem(q)
        return super().why_not(q, k, window, softcap)

    def device_problem(self, q: torch.Tensor) -> str:
        if q.is_cuda and not self.given and not torch.backends.cuda.is_flash_attention_available():
            return "this PyTorch was built without its flash-attention kernels"
        return super().device_problem(q)

    def _kfwd(self, q, k, v, pk, causal, window, softcap, scale):
        vals = dict(query=q, key=k, value=v, cum_seq_q=pk.cu_q, cum_seq_k=pk.cu_k, max_q=pk.max_q, max_k=pk.max_k,
                    dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale, window=window)  # fmt: skip
        res = self._fwd_op(**self.fwd_adapter.kwargs(vals))
        return res[0], res[1]

    def _kbwd(self, do, q, k, v, o, lse, pk, causal, window, softcap, scale):
        # dropout_p == 0: the philox seed/offset are not read; placeholders of the dtype the forward returns
        vals = dict(grad_out=do, query=q, key=k, value=v, out=o, logsumexp=lse, cum_seq_q=pk.cu_q, cum_seq_k=pk.cu_k,
                    max_q=pk.max_q, max_k=pk.max_k, dropout_p=0.0, is_causal=causal,
                    rng_state=torch.zeros(2, dtype=torch.int64, device=q.device),
                    unused=torch.zeros((), dtype=torch.int64, device=q.device), scale=scale, window=window)  # fmt: skip
        res = self._bwd_op(**self.bwd_adapter.kwargs(vals))
        return res[0], res[1], res[2]
