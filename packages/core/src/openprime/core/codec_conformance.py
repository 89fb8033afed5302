"""The conformance suite every Codec runs (re-exported by openprime.core.testing).

Subclass `CodecConformance` in a test module with `make_codec` (a zero-argument callable), the bound
`max_relative_error` of one encode/decode round trip on standard normal data, and optionally `device`
("cuda": the chunks live there; skipped where there is none). It checks what the ring all-reduce
relies on: payload buffers in host memory shaped like `payload_like`, decoding from a transport's copy
of them, fp32 accumulation, deterministic bytes, and replicas that end bit-identical.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from openprime.core.codec import Codec

NUMELS = (0, 1, 7, 4096, 50_001)  # empty (a ring chunk of a tiny tensor), odd and larger sizes


def _normal(numel: int, seed: int, device: str) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return values.to(device)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return 0.0 if want.numel() == 0 else ((got - want).norm() / want.norm()).item()


class CodecConformance:
    """The suite. Subclass with `make_codec = staticmethod(lambda: MyCodec())` and `max_relative_error`."""

    make_codec: Callable[[], Codec]
    max_relative_error: float
    device: str = "cpu"

    def _codec(self) -> Codec:
        if self.device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device here")
        return self.make_codec()

    @pytest.mark.parametrize("numel", NUMELS)
    def test_payload_is_host_memory_shaped_like_payload_like(self, numel):
        codec = self._codec()
        payload = codec.encode(_normal(numel, 0, self.device))
        like = codec.payload_like(numel)
        assert [(p.dtype, tuple(p.shape)) for p in payload] == [(p.dtype, tuple(p.shape)) for p in like]
        assert all(p.device.type == "cpu" and p.is_contiguous() for p in payload + like)  # what transports read

    @pytest.mark.parametrize("numel", NUMELS)
    def test_round_trip_error_is_bounded(self, numel):
        codec = self._codec()
        chunk = _normal(numel, 1, self.device)
        out = torch.full_like(chunk, 123.0)
        codec.decode_(out, codec.encode(chunk))
        assert out.device == chunk.device
        assert _relative_error(out, chunk) <= self.max_relative_error

    def test_decode_add_adds_exactly_what_decode_gives(self):
        codec = self._codec()
        payload = codec.encode(_normal(50_001, 2, self.device))
        decoded = torch.empty(50_001, dtype=torch.float32, device=self.device)
        codec.decode_(decoded, payload)
        acc = _normal(50_001, 3, self.device)
        expected = acc + decoded
        codec.decode_add_(acc, payload)
        assert torch.equal(acc, expected)

    @pytest.mark.parametrize("numel", NUMELS)
    def test_decode_add_encode_is_decode_add_then_encode(self, numel):
        codec = self._codec()
        payload = codec.encode(_normal(numel, 6, self.device))
        acc, fused_acc = _normal(numel, 7, self.device), _normal(numel, 7, self.device)
        codec.decode_add_(acc, payload)
        expected = codec.encode(acc)
        got = codec.decode_add_encode(fused_acc, payload)
        assert torch.equal(fused_acc, acc)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert a.device.type == "cpu" and a.is_contiguous()
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def test_a_transports_copy_of_the_payload_decodes_the_same(self):
        codec = self._codec()
        chunk = _normal(4096, 4, self.device)
        payload = codec.encode(chunk)
        received = codec.payload_like(chunk.numel())
        for buffer, sent in zip(received, payload, strict=True):
            buffer.copy_(sent)
        direct, copied = torch.empty_like(chunk), torch.empty_like(chunk)
        codec.decode_(direct, payload)
        codec.decode_(copied, received)
        assert torch.equal(direct, copied)

    def test_encoding_is_deterministic(self):
        codec = self._codec()
        chunk = _normal(50_001, 5, self.device)
        first = [p.clone() for p in codec.encode(chunk)]
        for _ in range(2):
            again = codec.encode(chunk.clone())
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(first, again, strict=True))

    def test_ring_all_reduce_leaves_replicas_bit_identical(self):
        from openprime.core.collectives import ring_all_reduce
        from openprime.core.testing import local_group, run_threads

        codec = self._codec()
        world, numel = 3, 50_001
        inputs = [_normal(numel, 10 + r, self.device) for r in range(world)]
        tensors = [t.clone() for t in inputs]
        transports = local_group(world)

        def rank(r):
            return lambda: ring_all_reduce(transports[r], tensors[r], deadline=time.monotonic() + 60, codec=codec)

        run_threads([rank(r) for r in range(world)])
        assert all(t.device == inputs[0].device for t in tensors)
        for t in tensors[1:]:
            assert torch.equal(t, tensors[0])  # every rank decodes the owner's bytes
        # Each chunk is encoded once per reduce-scatter step and once for the all-gather: world round trips.
        exact = torch.stack(inputs).sum(0)
        assert _relative_error(tensors[0], exact) <= world * self.max_relative_error + 1e-6
