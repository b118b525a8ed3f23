"""Attention kernels behind one interface, working on *pieces* of packed THD tensors (:mod:`.base`).

Backends, one module per kernel family: ``reference`` (plain masked softmax, any dtype and device), ``torch`` on CPU
(PyTorch's fused CPU flash kernel, :mod:`.torch_cpu`) and on CUDA (PyTorch's built-in varlen flash kernel,
:mod:`.torch_cuda`), ``flash_attn`` (flash-attn 2.x) and ``flash_attn3`` (flash-attn 3, Hopper) in :mod:`.flash`,
the CUDA varlen driver they share in :mod:`.varlen_cuda`, binding by parameter names in :mod:`.binding`; the choice
in :mod:`.select`; ``python -m attention.backends`` prints what is installed, what is chosen and why
(:func:`report`).
"""

from attention.backends.base import UNBOUNDED, Backend, Pieces, acc_dtype, check_inputs
from attention.backends.binding import ArgAdapter, signature_params
from attention.backends.flash import FlashAttn3Backend, FlashAttnBackend
from attention.backends.reference import ReferenceBackend
from attention.backends.report import report
from attention.backends.select import BACKENDS, REFERENCE_CUDA_MAX_LEN, get_backend
from attention.backends.torch_cpu import TorchCPUBackend
from attention.backends.torch_cuda import TorchCUDABackend
from attention.backends.varlen_cuda import Packed, VarlenCUDABackend, kernel_windows, split_tall

__all__ = [
    "UNBOUNDED",
    "Backend",
    "Pieces",
    "acc_dtype",
    "check_inputs",
    "ArgAdapter",
    "FlashAttn3Backend",
    "FlashAttnBackend",
    "signature_params",
    "ReferenceBackend",
    "BACKENDS",
    "REFERENCE_CUDA_MAX_LEN",
    "get_backend",
    "report",
    "TorchCPUBackend",
    "Packed",
    "TorchCUDABackend",
    "VarlenCUDABackend",
    "kernel_windows",
    "split_tall",
]
