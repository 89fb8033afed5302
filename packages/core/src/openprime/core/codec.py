"""The Codec interface: how a chunk of fp32 values travels inside a collective.

A codec turns a chunk into payload buffers (`encode`) and folds a received payload into an fp32
accumulator (`decode_add_`) or into an output (`decode_`). The ring all-reduce accumulates in fp32
whatever the codec, and in its all-gather forwards the owner's payload bytes unchanged, so every rank
decodes the same bytes and ends bit-identical (DESIGN.md, "Where PRIME fell short").

`Float32Codec` sends the values as they are. The int8 codebook quantizer of INTELLECT-1 lives in
openprime.kernels and implements the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Codec(ABC):
    """Encode fp32 chunks into payload buffers and decode them back, with fp32 accumulation."""

    name: str

    @abstractmethod
    def payload_like(self, numel: int) -> list[torch.Tensor]:
        """Preallocated receive buffers for the payload of a chunk of `numel` elements."""

    @abstractmethod
    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Payload buffers for the 1-D fp32 `chunk`. They may alias `chunk`; do not modify it until sent."""

    @abstractmethod
    def decode_add_(self, acc: torch.Tensor, payload: list[torch.Tensor]) -> None:
        """acc += decode(payload), in fp32."""

    @abstractmethod
    def decode_(self, out: torch.Tensor, payload: list[torch.Tensor]) -> None:
        """out = decode(payload)."""

    def receive_into(self, out: torch.Tensor) -> list[torch.Tensor] | None:
        """Payload buffers that alias `out`, for codecs whose payload is the values themselves (else None).

        The all-gather then receives straight into the result and forwards it without a copy.
        """
        return None


class Float32Codec(Codec):
    """Uncompressed fp32: the payload is the chunk itself (no copy on send)."""

    name = "fp32"

    def payload_like(self, numel: int) -> list[torch.Tensor]:
        return [torch.empty(numel, dtype=torch.float32)]

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        return [chunk.contiguous()]

    def decode_add_(self, acc: torch.Tensor, payload: list[torch.Tensor]) -> None:
        acc.add_(payload[0])

    def decode_(self, out: torch.Tensor, payload: list[torch.Tensor]) -> None:
        if out.data_ptr() != payload[0].data_ptr():
            out.copy_(payload[0])

    def receive_into(self, out: torch.Tensor) -> list[torch.Tensor] | None:
        return [out]
