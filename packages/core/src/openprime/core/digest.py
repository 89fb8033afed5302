"""Piece digests: XXH3 of the fixed-size pieces of a byte region, and the one hash they make together.

The global state (DiLoCo's weights and outer momentum) is hashed after every outer step so that the
replicas can be compared (DESIGN.md, "Where PRIME fell short"), and a joiner that receives it live must
check what arrived. Hashing the region as pieces of `PIECE_BYTES` rather than as one stream:

- spreads the hash over threads (xxhash releases the GIL): a 10B model's 80 GB of weights and momentum
  are about 7 s on one core at 12 GB/s, at every outer step;
- lets a donor send the digests it computed at the outer step as the checksums of the chunks it sends,
  instead of reading the state once more (openprime.core.state_transfer);
- lets a joiner check the whole state from the digests of the chunks it already checked, instead of
  reading it once more at the end.

    piece k     = bytes [k * P, min((k + 1) * P, total)) of the views' concatenation
    digest_k    = XXH3-64(piece k)                           (a piece may span two views)
    region hash = XXH3-128 of the digests' bytes (little-endian uint64), as hex

XXH3 detects corruption and drift, not forgery (authentication is the transports'); its 64-bit
digests of 1 MiB pieces and a 128-bit hash over them are far below any chance collision that matters.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

PIECE_BYTES = 1 << 20  # ~40 us of hashing a piece, against ~1 us of Python around it


def piece_digests(views: Sequence[torch.Tensor], *, piece_bytes: int = PIECE_BYTES,
                  num_threads: int = 1) -> np.ndarray:
    """XXH3-64 of every `piece_bytes` piece of the concatenated uint8 `views` (the last may be shorter), as
    a uint64 array; `num_threads` threads share the pieces."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    arrays = [v.numpy() for v in views if v.numel()]
    starts = np.cumsum([0] + [a.size for a in arrays])
    total = int(starts[-1])
    out = np.empty(-(-total // piece_bytes), dtype=np.uint64)

    def run(first: int, last: int) -> None:
        i = 0  # the view holding the current piece's first byte
        for k in range(first, last):
            lo, hi = k * piece_bytes, min((k + 1) * piece_bytes, total)
            while starts[i + 1] <= lo:
                i += 1
            if hi <= starts[i + 1]:  # within one view: one call, no hasher object
                out[k] = xxhash.xxh3_64_intdigest(arrays[i][lo - starts[i]: hi - starts[i]])
                continue
            h, j = xxhash.xxh3_64(), i
            while starts[j] < hi:
                h.update(arrays[j][max(lo, starts[j]) - starts[j]: min(hi, starts[j + 1]) - starts[j]])
                j += 1
            out[k] = h.intdigest()

    num_threads = max(1, min(num_threads, out.size))
    if num_threads == 1:
        run(0, out.size)
        return out
    bounds = np.linspace(0, out.size, num_threads + 1).astype(int)
    with concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="digest") as pool:
        for done in [pool.submit(run, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]:
            done.result()
    return out


def combine(digests: np.ndarray) -> str:
    """The region hash of these piece digests (XXH3-128 hex)."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(digests, dtype="<u8").tobytes())


def checksum(digests: np.ndarray) -> int:
    """A chunk's checksum from its pieces' digests: XXH3-64 as a signed int (it travels in an int64 header)."""
    value = xxhash.xxh3_64_intdigest(np.ascontiguousarray(digests, dtype="<u8").tobytes())
    return value - (1 << 64) if value >= 1 << 63 else value


def region_hash(views: Sequence[torch.Tensor], *, piece_bytes: int = PIECE_BYTES, num_threads: int = 1) -> str:
    """`combine(piece_digests(views))`: the hash of the views' concatenated bytes."""
    return combine(piece_digests(views, piece_bytes=piece_bytes, num_threads=num_threads))
