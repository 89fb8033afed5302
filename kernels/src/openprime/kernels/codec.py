"""Int8Codec: INTELLECT-1's int8 pseudo-gradient compression (paper section 2.2) as an openprime Codec.

The payload of a chunk of n fp32 values is [codes: uint8 (n,), codebook: float32 (256,)], 4x smaller
than fp32 (plus 1 KiB). The ring all-reduce accumulates in fp32 and forwards the owner's payload bytes
unchanged in its all-gather, so every rank decodes the same bytes; encoding is deterministic too (the
same chunk gives the same bytes on every call).
"""

from __future__ import annotations

import torch

from openprime.core.codec import Codec
from openprime.kernels.dispatch import dequantize_add_, dequantize_add_quantize_, dequantize_into_, quantize_int8
from openprime.kernels.params import DEFAULT_RANGE_SIGMAS, NUM_BUCKETS, check_range_sigmas


class Int8Codec(Codec):
    """uint8 codes plus a 256-entry fp32 codebook of bucket means, over mean +- range_sigmas * std."""

    name = "int8"

    def __init__(self, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> None:
        self.range_sigmas = check_range_sigmas(range_sigmas)

    def __repr__(self) -> str:
        return f"Int8Codec(range_sigmas={self.range_sigmas})"

    def payload_like(self, numel: int) -> list[torch.Tensor]:
        return [torch.empty(numel, dtype=torch.uint8), torch.empty(NUM_BUCKETS, dtype=torch.float32)]

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """[codes, codebook] for the fp32 chunk: new tensors, never views of the chunk."""
        codes, codebook = quantize_int8(chunk, self.range_sigmas)
        return [codes.reshape(-1), codebook]

    def decode_add_(self, acc: torch.Tensor, payload: list[torch.Tensor]) -> None:
        codes, codebook = self._unpack(payload)
        dequantize_add_(acc, codes, codebook)

    def decode_add_encode(self, acc: torch.Tensor, payload: list[torch.Tensor]) -> list[torch.Tensor]:
        codes, codebook = self._unpack(payload)
        codes, codebook = dequantize_add_quantize_(acc, codes, codebook, self.range_sigmas)
        return [codes.reshape(-1), codebook]

    def decode_(self, out: torch.Tensor, payload: list[torch.Tensor]) -> None:
        codes, codebook = self._unpack(payload)
        dequantize_into_(out, codes, codebook)

    @staticmethod
    def _unpack(payload: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(payload) != 2 or payload[1].numel() != NUM_BUCKETS:
            raise ValueError(f"an int8 payload is [codes, codebook of {NUM_BUCKETS}], got {len(payload)} buffers")
        return payload[0], payload[1]
