"""The Codec interface: how a chunk of fp32 values travels inside a collective.

A codec turns a chunk into payload buffers (`encode`) and folds a received payload into an fp32
accumulator (`decode_add_`) or into an output (`decode_`). The ring all-reduce accumulates in fp32
whatever the codec, and in its all-gather forwards the owner's payload bytes unchanged, so every rank
decodes the same bytes and ends bit-identical (DESIGN.md, "Where PRIME fell short").

`Float32Codec` sends the values as they are. The int8 codebook quantizer of INTELLECT-1 lives in
openprime.kernels and implements the same interface. `DeviceStagingCodec` wraps either for chunks that
live on an accelerator: the codec runs there and only its payload crosses to host memory, where the
transports read and write.
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

    def decode_add_encode(self, acc: torch.Tensor, payload: list[torch.Tensor]) -> list[torch.Tensor]:
        """acc += decode(payload), then the payload of the new acc: exactly `decode_add_` then `encode`.

        The ring's reduce-scatter does this for every chunk it passes on; a codec that can fold part of the
        encoding into the decoding pass (int8: the statistics of the sum as it is written) overrides it.
        """
        self.decode_add_(acc, payload)
        return self.encode(acc)

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


class DeviceStagingCodec(Codec):
    """`inner` run on the chunk's device (an accelerator), with every payload moved through host memory.

    encode: the payload is made on the device and copied to the host for the transport (for int8, one
    byte an element crosses, not four). decode_add_ and decode_: the received host payload is copied to
    the accumulator's device and decoded there. The copies are synchronous: the ring reuses its host
    receive buffers as soon as a decode returns, so no copy may still be reading one.
    """

    def __init__(self, inner: Codec) -> None:
        if isinstance(inner, DeviceStagingCodec):
            raise ValueError("DeviceStagingCodec wraps a codec that runs on the device, not another staging codec")
        self.inner = inner
        self.name = inner.name

    def __repr__(self) -> str:
        return f"DeviceStagingCodec({self.inner!r})"

    def payload_like(self, numel: int) -> list[torch.Tensor]:
        return self.inner.payload_like(numel)  # host buffers: the transports receive into them

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        return [_host_copy(p) for p in self.inner.encode(chunk)]

    def decode_add_(self, acc: torch.Tensor, payload: list[torch.Tensor]) -> None:
        self.inner.decode_add_(acc, [p.to(acc.device) for p in payload])

    def decode_(self, out: torch.Tensor, payload: list[torch.Tensor]) -> None:
        self.inner.decode_(out, [p.to(out.device) for p in payload])

    def decode_add_encode(self, acc: torch.Tensor, payload: list[torch.Tensor]) -> list[torch.Tensor]:
        return [_host_copy(p) for p in self.inner.decode_add_encode(acc, [p.to(acc.device) for p in payload])]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host tensor with t's values that does not alias t, even when t is already on the host."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def for_device(codec: Codec, device: torch.device) -> Codec:
    """`codec` for chunks on `device`: as it is on the host, wrapped in a DeviceStagingCodec elsewhere."""
    if device.type == "cpu" or isinstance(codec, DeviceStagingCodec):
        return codec
    return DeviceStagingCodec(codec)
