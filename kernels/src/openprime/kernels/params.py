"""The arithmetic every implementation of the int8 quantizer shares (paper section 2.2, "Int8 Ring-All-Reduce").

INTELLECT-1 quantizes a pseudo-gradient chunk x of n fp32 values uniformly over [mu - r*sigma, mu + r*sigma]
(r = `range_sigmas`, 6 in the paper) into 256 buckets; a code decodes to the mean of the values in its bucket.
The reference, the torch path and the Triton kernels must produce the same codes, so the bucket arithmetic
is pinned down here, to the last bit:

1. Statistics, in float64 around a pivot p = x[0] (any summation order; they differ in the last bits only):
       S = sum(x - p),  Q = sum((x - p)^2),  mu = p + S/n,  sigma = sqrt(max(Q/n - (S/n)^2, 0))
   The pivot makes constant input give S = Q = 0 exactly (so sigma = 0, whatever the order of summation)
   and keeps Q/n - (S/n)^2 from cancelling catastrophically when |mu| >> sigma.
2. Range, in float64: lo64 = mu - r*sigma, width64 = 2*r*sigma, step64 = width64/256.
3. The two fp32 numbers the bucketing uses: lo = fp32(lo64), scale = fp32(256/width64), or scale = 0 when
   the range is degenerate (sigma = 0, or 256/width64 not finite in fp32): then every value gets code 0.
4. Bucketing, in fp32, two separately rounded operations (no FMA contraction is possible):
       t = (x - lo) * scale;   code = trunc(clamp(t, 0, 255))   (== clamp(floor(t), 0, 255) for any t)
5. Codebook: codebook[k] = fp32(sum64_k / count_k), the mean of the values with code k (sums in float64);
   an empty bucket decodes to its centre fp32(lo64 + (k + 0.5) * step64).

Given the same (lo, scale), steps 4 and 5 give identical codes in every implementation; the statistics
differ between implementations only in the last bits of a float64, so (lo, scale) agree unless a float64
result lands within ~1e-16 (relative) of an fp32 rounding boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

NUM_BUCKETS = 256
DEFAULT_RANGE_SIGMAS = 6.0
_FP32_MAX = float(np.finfo(np.float32).max)


def fp32(value: float) -> float:
    """`value` rounded to the nearest fp32, as a Python float (exactly representable in fp32)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


@dataclass(frozen=True)
class QuantParams:
    """The range of one chunk: the fp32 pair the bucketing uses, and the float64 pair for bucket centres."""

    lo: float  # fp32-representable lower edge
    scale: float  # fp32-representable buckets per unit of x; 0 for a degenerate range
    lo64: float
    step64: float  # width of one bucket, float64


def check_range_sigmas(range_sigmas: float) -> float:
    r = float(range_sigmas)
    if not (math.isfinite(r) and r > 0):
        raise ValueError(f"range_sigmas must be a positive finite number, got {range_sigmas!r}")
    return r


def check_input(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise ValueError(f"the int8 quantizer takes float32 tensors, got {x.dtype}")


def non_finite_error(x: torch.Tensor) -> ValueError:
    """The error for a chunk whose statistics came out NaN/inf: some value in it is NaN or inf."""
    bad = int((~torch.isfinite(x)).sum())
    return ValueError(
        f"pseudo-gradient contains NaN/inf ({bad} of {x.numel()} values are not finite); cannot quantize it. "
        "This usually means training diverged: check the inner optimizer / learning rate (and grad clipping)."
    )


def quant_params(n: int, pivot: float, dsum: float, dsumsq: float, range_sigmas: float) -> QuantParams | None:
    """Steps 1-3 from the float64 sums S = sum(x - pivot), Q = sum((x - pivot)^2); None if they are not finite."""
    if not (math.isfinite(dsum) and math.isfinite(dsumsq)):
        return None
    if n == 0:
        return QuantParams(lo=0.0, scale=0.0, lo64=0.0, step64=0.0)
    dmean = dsum / n
    mu = pivot + dmean
    sigma = math.sqrt(max(dsumsq / n - dmean * dmean, 0.0))
    # Clamp to the fp32 range so that lo is finite even for values near fp32's maximum.
    lo64 = max(mu - range_sigmas * sigma, -_FP32_MAX)
    width64 = 2.0 * range_sigmas * sigma
    scale64 = NUM_BUCKETS / width64 if width64 > 0 else math.inf
    scale = fp32(scale64) if scale64 <= _FP32_MAX else 0.0
    return QuantParams(lo=fp32(lo64), scale=scale, lo64=lo64, step64=width64 / NUM_BUCKETS)


def bucket_centres(params: QuantParams) -> torch.Tensor:
    """float64 centres of the 256 buckets, lo64 + (k + 0.5) * step64 (what an empty bucket decodes to)."""
    k_256 = torch.arange(NUM_BUCKETS, dtype=torch.float64)
    return (k_256 + 0.5).mul_(params.step64).add_(params.lo64)


def finish_codebook(sums_256: torch.Tensor, counts_256: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """Step 5: fp32 codebook from float64 per-bucket sums and integer counts (CPU tensors)."""
    means_256 = sums_256.double() / counts_256.clamp(min=1).double()
    return torch.where(counts_256 > 0, means_256, bucket_centres(params)).float()


# A backend's decode: codebook[codes] written into `out` (accumulate=False) or added to it (True), in place, in fp32.
Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def decoders(decode: Decode) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor],
                                      Callable[..., torch.Tensor]]:
    """A backend's three public decode functions over its `decode`: (dequantize_add_, dequantize_into_,
    dequantize_int8). Each backend module binds them to those names (torch_ops, native_ops, triton_ops)."""

    def dequantize_add_(acc: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        """acc += codebook[codes] in fp32, in place; returns acc."""
        return decode(acc, codes, codebook, True)

    def dequantize_into_(out: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        """out = codebook[codes], in place; returns out."""
        return decode(out, codes, codebook, False)

    def dequantize_int8(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        """codebook[codes] as a new float32 tensor of the codes' shape."""
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        return decode(out, codes, codebook, False)

    return dequantize_add_, dequantize_into_, dequantize_int8
