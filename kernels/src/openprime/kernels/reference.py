"""The plain reference of INTELLECT-1's int8 quantizer (paper section 2.2): the definition the fast paths are
checked against. Slow and readable: numpy and Python loops, exactly rounded sums (math.fsum).

The arithmetic is specified step by step in openprime.kernels.params; this module follows it literally.
Shapes: N elements of the (flattened) chunk, K = 256 buckets.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from openprime.kernels.params import (
    DEFAULT_RANGE_SIGMAS,
    NUM_BUCKETS,
    QuantParams,
    check_input,
    check_range_sigmas,
    fp32,
    non_finite_error,
    quant_params,
)


def stats(x: torch.Tensor) -> tuple[int, float, float, float]:
    """(n, pivot, S, Q): S = sum(x - pivot), Q = sum((x - pivot)^2), exactly rounded float64 sums."""
    x_N = x.detach().reshape(-1).cpu().numpy().astype(np.float64)
    if x_N.size == 0:
        return 0, 0.0, 0.0, 0.0
    pivot = float(x_N[0])
    if not np.isfinite(x_N).all():
        return x_N.size, pivot, math.nan, math.nan
    d_N = x_N - pivot  # exact in float64 for any two fp32 values of similar magnitude
    return x_N.size, pivot, math.fsum(d_N), math.fsum(d_N * d_N)


def params_of(x: torch.Tensor, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> QuantParams:
    """The range of chunk `x` (steps 1-3); raises ValueError for NaN/inf."""
    check_input(x)
    params = quant_params(*stats(x), check_range_sigmas(range_sigmas))
    if params is None:
        raise non_finite_error(x)
    return params


def bucketize(x: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """Step 4: uint8 codes of x, computed in fp32 as trunc(clamp((x - lo) * scale, 0, 255))."""
    x_N = x.detach().reshape(-1).cpu().numpy()
    with np.errstate(over="ignore"):  # x - lo may overflow to inf for values near fp32's maximum: code 255
        t_N = (x_N - np.float32(params.lo)) * np.float32(params.scale)  # fp32 throughout
    codes_N = np.clip(np.floor(t_N), 0, NUM_BUCKETS - 1).astype(np.uint8)
    return torch.from_numpy(codes_N).reshape(x.shape)


def codebook_of(x: torch.Tensor, codes: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """Step 5: the mean of the values in each bucket (exactly rounded sum), the centre for an empty one."""
    x_N = x.detach().reshape(-1).cpu().numpy().astype(np.float64)
    codes_N = codes.reshape(-1).numpy()
    codebook = []
    for k in range(NUM_BUCKETS):
        members = x_N[codes_N == k]
        if members.size:
            codebook.append(math.fsum(members) / members.size)
        else:
            codebook.append(params.lo64 + (k + 0.5) * params.step64)
    return torch.tensor([fp32(v) for v in codebook], dtype=torch.float32)


def quantize_int8(x: torch.Tensor, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 of x's shape, codebook float32 (256,)) for the fp32 chunk x."""
    params = params_of(x, range_sigmas)
    codes = bucketize(x, params)
    return codes, codebook_of(x, codes, params)


def dequantize_int8(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """codebook[codes] as float32, one element at a time."""
    codebook_K = codebook.tolist()
    values = [codebook_K[c] for c in codes.reshape(-1).tolist()]
    return torch.tensor(values, dtype=torch.float32).reshape(codes.shape)


def dequantize_add_(acc: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """acc += codebook[codes], one fp32 addition per element."""
    acc += dequantize_int8(codes, codebook).reshape(acc.shape)
    return acc
