"""What is installed, what ``backend="auto"`` chooses and why: :func:`report` (``python -m attention.backends``)."""

from __future__ import annotations

from typing import Optional

import torch

_MASKS = (("no mask / causal", False, False), ("sliding window", True, False), ("softcap", False, True),
          ("sliding window + softcap", True, True))  # fmt: skip


def _describe(name: str, b) -> str:
    if getattr(b, "problem", ""):
        state = b.problem if getattr(b, "installed", False) else "not installed"
        return f"{name}: {state}"
    parts = [getattr(b, "version", "") or "version unknown"]
    if getattr(b, "source", ""):
        parts.append(f"bound to {b.source}")
    parts.append(f"sliding window {'yes' if b.has_window else 'no'}, softcap {'yes' if b.has_softcap else 'no'}")
    if name == "torch" and not b.available():
        parts.append("this PyTorch was built without its CUDA flash kernels")
    return f"{name}: " + "; ".join(parts)


def report(device: Optional[str] = None, dtype: Optional[torch.dtype] = None, head_dim: int = 128) -> str:
    """A few lines: every kernel backend's state (not installed / installed but refused, with the reason / bound,
    with the signature it was bound to and the masks it takes), then the choice ``auto`` makes on ``device``
    (default: CUDA device 0 when there is one, else CPU) for ``dtype`` (bfloat16 on CUDA, float32 on CPU) with
    each mask, and why the preferred kernels refused. Builds (imports) the kernel packages."""
    from attention.backends import select

    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    dev = torch.device(device) if device is not None else torch.device("cuda" if cuda else "cpu")
    state = "available" if torch.cuda.is_available() else "not available"
    lines = [f"attention backends (torch {torch.__version__}, CUDA {state})"]
    for name in ("flash_attn3", "flash_attn", "torch"):
        lines.append("  " + _describe(name, select._backend(name, True)) + ("  [CUDA]" if name == "torch" else ""))
    lines.append("  torch [CPU]: aten._scaled_dot_product_flash_attention_for_cpu; sliding-window and softcap blocks "
                 "run on the reference kernel (logged once)")  # fmt: skip
    lines.append("  reference: plain masked softmax, any dtype and device")
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    where = f"{dev}" + (f" (compute capability {torch.cuda.get_device_capability(dev)})" if dev.type == "cuda" else "")
    lines.append(f"auto on {where}, {dt}, head_dim {head_dim}, GQA 2:1:")
    q = torch.zeros(1, 2, head_dim, dtype=dt, device=dev)
    k = q[:, :1]
    for label, window, softcap in _MASKS:
        b, refused = select.choose(q, k, window, softcap)
        chosen = b.name if b is not None else "reference"
        why = "; ".join(f"not {n}: {w}" for n, w in refused)
        lines.append(f"  {label}: {chosen}" + (f" ({why})" if why else ""))
    return "\n".join(lines)
