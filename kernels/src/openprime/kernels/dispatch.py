"""Which implementation of the int8 quantizer (paper section 2.2) runs for a tensor.

CUDA tensors go to the Triton kernels when triton can be imported; everything else (CPU, or CUDA
without triton) goes to the vectorised torch path. With OPENPRIME_INT8_NATIVE=1, CPU tensors go to the
C++ path (native_ops) instead, which is compiled on its first use and falls back to the torch path if it
cannot be built. Triton is imported here lazily, on the first CUDA tensor, so `import openprime.kernels`
never imports it or compiles anything, and a missing triton only means the torch path is used.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

from openprime.kernels import native_ops, torch_ops
from openprime.kernels.params import DEFAULT_RANGE_SIGMAS

log = logging.getLogger(__name__)


@functools.cache
def _triton_ops() -> ModuleType | None:
    try:
        return importlib.import_module("openprime.kernels.triton_ops")
    except ImportError as e:  # no triton (or a broken install): the torch path serves CUDA tensors too
        log.info("openprime.kernels: triton unavailable (%s); using the torch path for CUDA tensors", e)
        return None


def backend_for(x: torch.Tensor) -> ModuleType:
    """The module (triton_ops, native_ops or torch_ops) that handles tensor x."""
    if x.is_cuda:
        return _triton_ops() or torch_ops
    if x.device.type == "cpu" and native_ops.available():
        return native_ops
    return torch_ops


def quantize_int8(x: torch.Tensor, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes: uint8 tensor of x's shape, codebook: float32 tensor of 256) for the float32 tensor x.

    Buckets are 256 equal parts of [mean - range_sigmas * std, mean + range_sigmas * std]; values outside
    go to the end buckets; a code decodes to the mean of the values in its bucket (the centre if empty).
    Raises ValueError if x holds NaN or inf.
    """
    return backend_for(x).quantize_int8(x, range_sigmas)


def dequantize_int8(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """codebook[codes]: a new float32 tensor of the codes' shape."""
    return backend_for(codes).dequantize_int8(codes, codebook)


def dequantize_add_(acc: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """acc += codebook[codes], fused and in fp32; acc is contiguous float32 with as many elements as codes."""
    return backend_for(acc).dequantize_add_(acc, codes, codebook)


def dequantize_into_(out: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """out = codebook[codes], in place; out is contiguous float32 with as many elements as codes."""
    return backend_for(out).dequantize_into_(out, codes, codebook)


def dequantize_add_quantize_(acc: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor,
                             range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """acc += codebook[codes], then quantize_int8(acc): the same results as the two calls. A backend that fuses
    them (native_ops: the statistics taken while adding) defines it; for the others it is the two calls."""
    backend = backend_for(acc)
    fused = getattr(backend, "dequantize_add_quantize_", None)
    if fused is not None:
        return fused(acc, codes, codebook, range_sigmas)
    backend.dequantize_add_(acc, codes, codebook)
    return backend.quantize_int8(acc, range_sigmas)
