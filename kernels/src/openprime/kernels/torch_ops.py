"""The vectorised torch path of INTELLECT-1's int8 quantizer (paper section 2.2), for CPU and any device.

The paper's C++ kernels made quantization more than 60x faster than plain PyTorch. A plain composition of
torch ops over a whole chunk makes each op a separate pass over DRAM. Here the chunk is cut into blocks
of BLOCK_N elements whose fp32, float64 and integer scratch stays in the core's L2 cache, so the ~14 ops
of a block read cache, not DRAM, and the blocks are spread over `torch.get_num_threads()` worker
threads (torch ops release the GIL). Blocks are under ATen's grain size (32768 elements), so every op in
a worker runs inline on that worker's thread: no nested OpenMP teams.

Two passes over the chunk (the arithmetic is in openprime.kernels.params):
  1. per block: d = float64(x) - pivot; S_b = sum(d); Q_b = |d|^2          (then S, Q = fsum over blocks)
  2. per block: codes = trunc(clamp((x - lo) * scale, 0, 255)) in fp32, via int32 (faster than a direct
     fp32 -> uint8 conversion); per-bucket float64 sums of x (bincount with float64 weights) and counts.
The codebook is exact: every value counts. The two bincounts are about 40% of the time.

Determinism: blocks have a fixed size and their partial results are combined in block order (fsum for
the statistics, a sequential cumsum for the bucket sums), so the same input gives bit-identical codes
and codebook on every call, whatever the number of threads.

Measured and rejected (kernels/README.md has the numbers): torch.compile (inductor turns the per-bucket
sums into atomic scatter loops, ~13 ns an element, and its float64 statistics pass was no faster than
this one); a codebook from a fixed-stride sample (its error exceeds the exact codebook's by more than
1% on heavy-tailed data: outliers in the end buckets are missed or over-weighted); dot() for Q (MKL
starts threads of its own inside the workers).

Shapes: N elements of the chunk, B elements of a block, K = 256 buckets.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

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

# Under ATen's grain size (32768) so that no op goes parallel inside a worker, a multiple of 256 for
# alignment, and small enough that a block's fp32, float64 and uint8 buffers (~0.4 MB) stay in L2.
BLOCK_N = 32768 - 256
# Below this many elements a chunk is not worth handing to other threads.
MIN_PARALLEL_N = 4 * BLOCK_N

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="openprime-int8")
        return _pool


def _forget_pool_after_fork() -> None:
    # A forked child inherits the pool object but none of its threads: it must start its own.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _block_n(x: torch.Tensor) -> int:
    """Cache-sized blocks on CPU; elsewhere (an accelerator without Triton) whole-tensor ops."""
    return BLOCK_N if x.device.type == "cpu" else max(x.numel(), 1)


def _run_blocks(n: int, block_n: int, work: Callable[[int, int], list]) -> list:
    """work(start, stop) over contiguous ranges of whole blocks, one range per thread; results in block order."""
    num_blocks = -(-n // block_n)
    threads = min(torch.get_num_threads(), num_blocks) if n >= MIN_PARALLEL_N and block_n == BLOCK_N else 1
    if threads <= 1:
        return work(0, n)
    per_thread = -(-num_blocks // threads) * block_n
    ranges = [(start, min(start + per_thread, n)) for start in range(0, n, per_thread)]
    futures = [_executor().submit(work, start, stop) for start, stop in ranges[1:]]
    results = work(*ranges[0])  # the calling thread takes the first range
    for future in futures:
        results += future.result()
    return results


def _fit(buffer_B: torch.Tensor, numel: int) -> torch.Tensor:
    """The scratch buffer, or its head for a short last block."""
    return buffer_B if buffer_B.numel() == numel else buffer_B[:numel]


def _stats_work(x_N: torch.Tensor, pivot: float, block_n: int) -> Callable[[int, int], list]:
    def work(start: int, stop: int) -> list[tuple[float, float]]:
        d_B = torch.empty(min(block_n, stop - start), dtype=torch.float64, device=x_N.device)
        out = []
        for x_b in x_N[start:stop].split(block_n):
            d_b = _fit(d_B, x_b.numel())
            d_b.copy_(x_b).sub_(pivot)  # exact: the difference of two fp32 values fits a float64
            # |d|^2 via the 2-norm, not dot(d, d): ATen's own loop, where MKL would start threads of its own.
            out.append((d_b.sum().item(), torch.linalg.vector_norm(d_b).item() ** 2))
        return out

    return work


def stats(x_N: torch.Tensor) -> tuple[int, float, float, float]:
    """(n, pivot, S, Q) of the flat chunk: S = sum(x - pivot), Q = sum((x - pivot)^2) in float64."""
    n = x_N.numel()
    if n == 0:
        return 0, 0.0, 0.0, 0.0
    pivot = x_N[0].item()
    block_n = _block_n(x_N)
    partials = _run_blocks(n, block_n, _stats_work(x_N, pivot, block_n))
    # fsum: exactly rounded, so the result does not depend on how the blocks were split.
    return n, pivot, math.fsum(s for s, _ in partials), math.fsum(q for _, q in partials)


def params_of(x_N: torch.Tensor, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> QuantParams:
    params = quant_params(*stats(x_N), check_range_sigmas(range_sigmas))
    if params is None:
        raise non_finite_error(x_N)
    return params


def _bucket_work(
    x_N: torch.Tensor, codes_N: torch.Tensor, params: QuantParams, block_n: int
) -> Callable[[int, int], list]:
    def work(start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = min(block_n, stop - start)
        t_B = torch.empty(size, device=x_N.device)
        i_B = torch.empty(size, dtype=torch.int32, device=x_N.device)
        d_B = torch.empty(size, dtype=torch.float64, device=x_N.device)
        out = []
        for x_b, codes_b in zip(x_N[start:stop].split(block_n), codes_N[start:stop].split(block_n), strict=True):
            t_b, i_b, d_b = _fit(t_B, x_b.numel()), _fit(i_B, x_b.numel()), _fit(d_B, x_b.numel())
            # t = (x - lo) * scale in fp32; the integer conversion truncates, which after the clamp is floor.
            torch.sub(x_b, params.lo, out=t_b).mul_(params.scale).clamp_(0, NUM_BUCKETS - 1)
            codes_b.copy_(i_b.copy_(t_b))  # via int32: faster than ATen's direct fp32 -> uint8 conversion
            d_b.copy_(x_b)  # float64 weights: bincount accumulates in the weights' dtype
            sums_K = torch.bincount(codes_b, weights=d_b, minlength=NUM_BUCKETS)
            out.append((sums_K, torch.bincount(codes_b, minlength=NUM_BUCKETS)))
        return out

    return work


def bucketize_and_codebook(x_N: torch.Tensor, params: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4 and 5 for the flat chunk: (codes_N uint8, codebook_K fp32)."""
    codes_N = torch.empty(x_N.numel(), dtype=torch.uint8, device=x_N.device)
    if x_N.numel() == 0:
        zeros_K = torch.zeros(NUM_BUCKETS, dtype=torch.int64)
        return codes_N, finish_codebook(zeros_K.double(), zeros_K, params).to(x_N.device)
    block_n = _block_n(x_N)
    blocks = _run_blocks(x_N.numel(), block_n, _bucket_work(x_N, codes_N, params, block_n))
    # cumsum adds the blocks' float64 sums one after another, in block order: the same on every call,
    # whatever the number of threads. Counts are integers: any order gives the same.
    sums_K = torch.stack([sums for sums, _ in blocks]).cumsum(dim=0)[-1]
    counts_K = torch.stack([counts for _, counts in blocks]).sum(dim=0)
    return codes_N, finish_codebook(sums_K.cpu(), counts_K.cpu(), params).to(x_N.device)


def quantize_int8(x: torch.Tensor, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 of x's shape, codebook float32 (256,)) for the fp32 chunk x."""
    check_input(x)
    x_N = x.detach().reshape(-1)  # a view when x is contiguous
    codes_N, codebook_K = bucketize_and_codebook(x_N, params_of(x_N, range_sigmas))
    return codes_N.reshape(x.shape), codebook_K


def _decode_work(
    out_N: torch.Tensor, codes_N: torch.Tensor, codebook_K: torch.Tensor, accumulate: bool
) -> Callable[[int, int], list]:
    def work(start: int, stop: int) -> list:
        size = min(BLOCK_N, stop - start)
        index_B, v_B = torch.empty(size, dtype=torch.int32), torch.empty(size)
        for out_b, codes_b in zip(out_N[start:stop].split(BLOCK_N), codes_N[start:stop].split(BLOCK_N), strict=True):
            index_b = _fit(index_B, out_b.numel())
            index_b.copy_(codes_b)  # uint8 would index as a mask; int32 is the narrowest integer index
            if accumulate:
                v_b = _fit(v_B, out_b.numel())
                out_b.add_(torch.index_select(codebook_K, 0, index_b, out=v_b))
            else:
                torch.index_select(codebook_K, 0, index_b, out=out_b)
        return []

    return work


def _decode(out: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, accumulate: bool) -> torch.Tensor:
    if out.dtype != torch.float32 or codes.dtype != torch.uint8 or out.numel() != codes.numel():
        raise ValueError(
            f"need a float32 output and uint8 codes of the same size, got {out.dtype} {tuple(out.shape)} "
            f"and {codes.dtype} {tuple(codes.shape)}"
        )
    if not out.is_contiguous():
        raise ValueError("the output of a decode is written in place and must be contiguous")
    codes_N = codes.reshape(-1).to(out.device)
    codebook_K = codebook.to(device=out.device, dtype=torch.float32)
    out_N = out.view(-1)
    if out.device.type != "cpu":  # elsewhere, one pass of whole-tensor ops
        values_N = codebook_K[codes_N.long()]
        out_N.add_(values_N) if accumulate else out_N.copy_(values_N)
        return out
    _run_blocks(out.numel(), BLOCK_N, _decode_work(out_N, codes_N, codebook_K, accumulate))
    return out


dequantize_add_, dequantize_into_, dequantize_int8 = decoders(_decode)
