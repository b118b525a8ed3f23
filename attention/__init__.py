"""attention: exact context-parallel attention over packed variable-length documents.

``CPLayout`` says which tokens each CP rank holds; ``cp_attention`` computes exact attention over the sharded
documents (ring, all-gather or Ulysses), with causal, sliding-window and softcap masks; ``varlen_attention`` is the
single-device packed attention. Kernels: flash-attn 2/3 on CUDA, PyTorch's fused kernels on CPU/CUDA, a plain
reference (``attention.backends``). ``bytes_sent()`` / ``reset_bytes_sent()`` count the bytes this process sent
through CP attention transfers. ``attention.geometry`` (the chunk rules and pair counts) and
``attention.placement`` (the hybrid placement) need no torch; the names here are imported on first use, so
``import attention.geometry`` stays light.
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "CPLayout": "attention.layout",
    "cp_attention": "attention.cp",
    "METHODS": "attention.cp",
    "varlen_attention": "attention.varlen",
    "get_backend": "attention.backends.select",
    "BACKENDS": "attention.backends.select",
    "Backend": "attention.backends.base",
    "Pieces": "attention.backends.base",
    "merge_": "attention.merge",
    "Mask": "attention.masks",
    "bytes_sent": "attention._dist",
    "reset_bytes_sent": "attention._dist",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
