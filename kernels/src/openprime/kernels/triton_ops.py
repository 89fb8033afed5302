"""Triton kernels for INTELLECT-1's int8 quantizer (paper section 2.2), used for CUDA tensors.

Four kernels, with the arithmetic of openprime.kernels.params:
  _stats_kernel     per-program float64 partial sums S = sum(x - pivot) and Q = sum((x - pivot)^2)
  _bucket_kernel    writes the uint8 codes and per-program partial histograms: float64 sums and int32
                    counts of the values in each of the 256 buckets
  _finalise_kernel  adds the partial histograms in program order and writes the fp32 codebook
  _decode_kernel    out = codebook[codes], or acc += codebook[codes] (fused dequantize-add)

No atomics: every program owns a row of partial results, and the rows are combined in a fixed order,
so the same input gives the same bytes on every call. The host reads the P x 2 stat partials once
(one sync per chunk) to compute (lo, scale) in Python exactly as the reference does.

Each program builds its histogram with a one-hot reduction: a tile of B values against the 256 bucket
ids is a B x 256 comparison, summed over the tile in float64. That is 256 compare/select/add per value,
cheap beside the network this serves, and it keeps the sums exact to float64 and the order fixed.

Triton is imported only by this module, which openprime.kernels imports on first use with a CUDA tensor.
With TRITON_INTERPRET=1 in the environment before triton is first imported, the kernels run in Triton's
CPU interpreter on CPU tensors: that is how the tests check them (in a subprocess) without a GPU.

Shapes: N elements of the chunk, B elements of a tile, K = 256 buckets, P programs.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from openprime.kernels.params import (
    DEFAULT_RANGE_SIGMAS,
    NUM_BUCKETS,
    QuantParams,
    check_input,
    check_range_sigmas,
    decoders,
    finish_codebook,
    non_finite_error,
    quant_params,
)

STATS_BLOCK = 1024
BUCKET_BLOCK = 32  # the one-hot tile is B x 256 float64: 32 registers a thread over 8 warps
BUCKET_WARPS = 8
DECODE_BLOCK = 1024
INTERPRETER_PROGRAMS = 4  # the interpreter runs programs one after another: keep them few


@triton.jit
def _stats_kernel(x_ptr, partial_ptr, pivot, n, tiles_per_program, BLOCK: tl.constexpr):
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    offsets_B = tl.arange(0, BLOCK)
    s_B = tl.zeros([BLOCK], dtype=tl.float64)
    q_B = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(tiles_per_program):
        # Tiles interleave across programs; int64 offsets so that chunks over 2^31 elements work.
        idx_B = (i * num_programs + pid).to(tl.int64) * BLOCK + offsets_B
        mask_B = idx_B < n
        x_B = tl.load(x_ptr + idx_B, mask=mask_B, other=0.0)
        d_B = tl.where(mask_B, x_B.to(tl.float64) - pivot, 0.0)  # exact: fp32 difference in float64
        s_B += d_B
        q_B += d_B * d_B
    tl.store(partial_ptr + 2 * pid, tl.sum(s_B, axis=0))
    tl.store(partial_ptr + 2 * pid + 1, tl.sum(q_B, axis=0))


@triton.jit
def _bucket_kernel(x_ptr, codes_ptr, psum_ptr, pcount_ptr, lo, scale, n, tiles_per_program,
                   BLOCK: tl.constexpr, K: tl.constexpr):
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    offsets_B = tl.arange(0, BLOCK)
    k_K = tl.arange(0, K)
    sums_K = tl.zeros([K], dtype=tl.float64)
    counts_K = tl.zeros([K], dtype=tl.int32)
    for i in range(tiles_per_program):
        idx_B = (i * num_programs + pid).to(tl.int64) * BLOCK + offsets_B
        mask_B = idx_B < n
        x_B = tl.load(x_ptr + idx_B, mask=mask_B, other=0.0)
        # t = (x - lo) * scale: two fp32 roundings, as in the reference; truncation after the clamp is floor.
        t_B = (x_B - lo) * scale
        t_B = tl.minimum(tl.maximum(t_B, 0.0), K - 1.0)
        code_B = t_B.to(tl.int32)
        tl.store(codes_ptr + idx_B, code_B.to(tl.uint8), mask=mask_B)
        # One-hot histogram of the tile: hit_BK[b, k] says value b fell in bucket k.
        hit_BK = (code_B[:, None] == k_K[None, :]) & mask_B[:, None]
        sums_K += tl.sum(tl.where(hit_BK, x_B.to(tl.float64)[:, None], 0.0), axis=0)
        counts_K += tl.sum(hit_BK.to(tl.int32), axis=0)
    tl.store(psum_ptr + pid * K + k_K, sums_K)
    tl.store(pcount_ptr + pid * K + k_K, counts_K)


@triton.jit
def _finalise_kernel(psum_ptr, pcount_ptr, range_ptr, codebook_ptr, num_partials, K: tl.constexpr):
    k_K = tl.arange(0, K)
    sums_K = tl.zeros([K], dtype=tl.float64)
    counts_K = tl.zeros([K], dtype=tl.int64)
    for p in range(num_partials):  # in program order: the same sums on every call
        sums_K += tl.load(psum_ptr + p * K + k_K)
        counts_K += tl.load(pcount_ptr + p * K + k_K).to(tl.int64)
    lo64, step64 = tl.load(range_ptr), tl.load(range_ptr + 1)
    centres_K = lo64 + (k_K.to(tl.float64) + 0.5) * step64  # what an empty bucket decodes to
    means_K = sums_K / tl.maximum(counts_K, 1).to(tl.float64)
    tl.store(codebook_ptr + k_K, tl.where(counts_K > 0, means_K, centres_K).to(tl.float32))


@triton.jit
def _decode_kernel(codes_ptr, codebook_ptr, out_ptr, n, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    idx_B = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask_B = idx_B < n
    code_B = tl.load(codes_ptr + idx_B, mask=mask_B, other=0).to(tl.int32)
    v_B = tl.load(codebook_ptr + code_B, mask=mask_B, other=0.0)  # a gather from the 1 KiB codebook
    if ACCUMULATE:
        v_B += tl.load(out_ptr + idx_B, mask=mask_B, other=0.0)  # one fp32 addition, as acc.add_()
    tl.store(out_ptr + idx_B, v_B, mask=mask_B)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_programs(n: int, block: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (4 per SM), each looping over its tiles; few in the interpreter."""
    if _interpreting():
        cap = INTERPRETER_PROGRAMS
    else:
        cap = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(cap, -(-n // block)))


def _range(x_N: torch.Tensor, range_sigmas: float) -> QuantParams:
    """Steps 1-3: float64 partial statistics on the device, summed and turned into (lo, scale) on the host."""
    n, pivot = x_N.numel(), x_N[0].item()
    programs = _num_programs(n, STATS_BLOCK, x_N.device)
    partial_P2 = torch.empty((programs, 2), dtype=torch.float64, device=x_N.device)
    tiles = -(-n // (STATS_BLOCK * programs))
    _stats_kernel[(programs,)](x_N, partial_P2, pivot, n, tiles, BLOCK=STATS_BLOCK)
    partials = partial_P2.tolist()  # the one device-to-host sync of a quantize
    s, q = math.fsum(p[0] for p in partials), math.fsum(p[1] for p in partials)
    params = quant_params(n, pivot, s, q, range_sigmas)
    if params is None:
        raise non_finite_error(x_N)
    return params


def _codes_and_codebook(x_N: torch.Tensor, params: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4-5: codes and per-program partial histograms, then the codebook from their ordered sum."""
    n, device = x_N.numel(), x_N.device
    programs = _num_programs(n, BUCKET_BLOCK, device)
    codes_N = torch.empty(n, dtype=torch.uint8, device=device)
    psum_PK = torch.empty((programs, NUM_BUCKETS), dtype=torch.float64, device=device)
    pcount_PK = torch.empty((programs, NUM_BUCKETS), dtype=torch.int32, device=device)
    tiles = -(-n // (BUCKET_BLOCK * programs))
    _bucket_kernel[(programs,)](
        x_N, codes_N, psum_PK, pcount_PK, params.lo, params.scale, n, tiles,
        BLOCK=BUCKET_BLOCK, K=NUM_BUCKETS, num_warps=BUCKET_WARPS,
    )
    range_2 = torch.tensor([params.lo64, params.step64], dtype=torch.float64, device=device)
    codebook_K = torch.empty(NUM_BUCKETS, dtype=torch.float32, device=device)
    _finalise_kernel[(1,)](psum_PK, pcount_PK, range_2, codebook_K, programs, K=NUM_BUCKETS)
    return codes_N, codebook_K


def quantize_int8(x: torch.Tensor, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 of x's shape, codebook float32 (256,)) for the fp32 chunk x, on x's device."""
    check_input(x)
    r = check_range_sigmas(range_sigmas)
    x_N = x.detach().reshape(-1).contiguous()
    if x_N.numel() == 0:  # no kernels: a codebook of centres (all 0)
        zeros_K = torch.zeros(NUM_BUCKETS, dtype=torch.int64)
        codebook_K = finish_codebook(zeros_K.double(), zeros_K, quant_params(0, 0.0, 0.0, 0.0, r))
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device), codebook_K.to(x.device)
    codes_N, codebook_K = _codes_and_codebook(x_N, _range(x_N, r))
    return codes_N.reshape(x.shape), codebook_K


def _decode(out: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, accumulate: bool) -> torch.Tensor:
    if out.dtype != torch.float32 or codes.dtype != torch.uint8 or out.numel() != codes.numel():
        raise ValueError(
            f"need a float32 output and uint8 codes of the same size, got {out.dtype} {tuple(out.shape)} "
            f"and {codes.dtype} {tuple(codes.shape)}"
        )
    if not out.is_contiguous():
        raise ValueError("the output of a decode is written in place and must be contiguous")
    n = out.numel()
    if n == 0:
        return out
    codes_N = codes.reshape(-1).to(out.device).contiguous()
    codebook_K = codebook.to(device=out.device, dtype=torch.float32).contiguous()
    grid = (-(-n // DECODE_BLOCK),)
    _decode_kernel[grid](codes_N, codebook_K, out, n, ACCUMULATE=accumulate, BLOCK=DECODE_BLOCK)
    return out


dequantize_add_, dequantize_into_, dequantize_int8 = decoders(_decode)
