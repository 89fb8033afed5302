"""openprime.kernels: INTELLECT-1's int8 codebook quantizer for pseudo-gradients (paper section 2.2).

    codes, codebook = quantize_int8(x)          # uint8 codes of x's shape, float32 codebook of 256
    y = dequantize_int8(codes, codebook)        # codebook[codes]
    dequantize_add_(acc, codes, codebook)       # acc += codebook[codes], fused, fp32
    codec = Int8Codec()                         # the same as an openprime.core Codec for ring_all_reduce

Three implementations compute the same codes: `reference` (plain, the definition), `torch_ops`
(vectorised, CPU and any device) and `triton_ops` (CUDA), plus `native_ops`, an opt-in C++ path for
CPU (OPENPRIME_INT8_NATIVE=1; built on first use). CUDA tensors use Triton when it can be imported;
everything else uses torch_ops, or native_ops when asked for. Importing this package imports neither triton nor compiles
anything. The arithmetic all three share is written out in `openprime.kernels.params`.
"""

from openprime.kernels.codec import Int8Codec
from openprime.kernels.dispatch import backend_for, dequantize_add_, dequantize_int8, dequantize_into_, quantize_int8
from openprime.kernels.params import DEFAULT_RANGE_SIGMAS, NUM_BUCKETS

__all__ = [
    "DEFAULT_RANGE_SIGMAS",
    "NUM_BUCKETS",
    "Int8Codec",
    "backend_for",
    "dequantize_add_",
    "dequantize_int8",
    "dequantize_into_",
    "quantize_int8",
]
