"""Edge cases of the int8 ring all-reduce over in-process transports: every rank must end bit-identical
(the owner's bytes are the only ones decoded) whatever the sizes, values, buffers or quantizer path."""

import time

import pytest
import torch

from openprime.core.collectives import RingBuffers, ring_all_reduce
from openprime.core.errors import PeerFailure
from openprime.core.testing import local_group, run_threads
from openprime.kernels import Int8Codec, torch_ops


def _ring(inputs, codecs, *, segment_numel=1 << 20, buffers=None, deadline_s=30.0):
    n = len(inputs)
    transports, outs = local_group(n), [x.clone() for x in inputs]
    deadline = time.monotonic() + deadline_s

    def rank(r):
        return lambda: ring_all_reduce(transports[r], outs[r], deadline=deadline, codec=codecs[r],
                                       segment_numel=segment_numel, buffers=buffers[r] if buffers else None)

    run_threads([rank(r) for r in range(n)], timeout_s=deadline_s + 10)
    return outs


def _bits(x):
    return x.view(torch.int32)


def _assert_identical(outs):
    assert all(torch.equal(_bits(o), _bits(outs[0])) for o in outs), "ranks must end bit-identical"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel,segment_numel", [(0, 1 << 20), (1, 1 << 20), (3, 1), (7, 2), (1001, 64)])
def test_bit_identical_for_awkward_sizes(n, numel, segment_numel):
    g = torch.Generator().manual_seed(numel * 10 + n)
    inputs = [torch.randn(numel, generator=g) for _ in range(n)]
    outs = _ring(inputs, [Int8Codec()] * n, segment_numel=segment_numel)
    _assert_identical(outs)
    if n == 1:
        assert torch.equal(outs[0], inputs[0])


_VALUES = {
    "constant": lambda r, g: torch.full((999,), 0.25),
    "zeros": lambda r, g: torch.zeros(999),
    "negative_zeros": lambda r, g: torch.full((999,), -0.0),
    "subnormal": lambda r, g: torch.randn(999, generator=g) * 1e-40,
    "huge": lambda r, g: torch.randn(999, generator=g) * 1e30,
    "one_contributor": lambda r, g: torch.randn(999, generator=g) if r == 0 else torch.zeros(999),
    "one_non_contributor": lambda r, g: torch.zeros(999) if r == 1 else torch.randn(999, generator=g),
}


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("kind", sorted(_VALUES))
def test_bit_identical_for_edge_values(n, kind):
    g = torch.Generator().manual_seed(n)
    inputs = [_VALUES[kind](r, g) for r in range(n)]
    outs = _ring(inputs, [Int8Codec()] * n, segment_numel=100)
    _assert_identical(outs)
    assert torch.isfinite(outs[0]).all()
    if kind in ("constant", "zeros", "negative_zeros"):  # constant chunks decode exactly
        assert torch.equal(outs[0], torch.stack(inputs).sum(0))


def test_reused_buffers_across_sizes_give_the_fresh_result():
    n, g = 3, torch.Generator().manual_seed(1)
    buffers = [RingBuffers() for _ in range(n)]
    for numel, segment_numel in [(1001, 100), (37, 100), (1001, 100), (500, 7), (2, 1), (1001, 100)]:
        inputs = [torch.randn(numel, generator=g) for _ in range(n)]
        reused = _ring(inputs, [Int8Codec()] * n, segment_numel=segment_numel, buffers=buffers)
        fresh = _ring(inputs, [Int8Codec()] * n, segment_numel=segment_numel)
        _assert_identical(reused + fresh)


def test_nan_is_a_clear_error_and_every_tensor_is_restored():
    n, g = 3, torch.Generator().manual_seed(2)
    inputs = [torch.randn(300, generator=g) for _ in range(n)]
    inputs[0][5] = float("nan")  # rank 0 encodes its own chunk 0 first: it raises at once
    transports, outs = local_group(n), [x.clone() for x in inputs]
    deadline = time.monotonic() + 1.0
    errors = []

    def rank(r):
        def body():
            try:
                ring_all_reduce(transports[r], outs[r], deadline=deadline, codec=Int8Codec(), segment_numel=50)
            except (ValueError, PeerFailure) as e:
                errors.append((r, type(e)))
        return body

    run_threads([rank(r) for r in range(n)], timeout_s=20)
    assert (0, ValueError) in errors and len(errors) == n  # the others lose their neighbour: PeerFailure
    assert all(torch.equal(_bits(o), _bits(x)) for o, x in zip(outs, inputs, strict=True))


class _TorchPathInt8(Int8Codec):
    """Int8Codec pinned to the torch path, as on a replica without OPENPRIME_INT8_NATIVE."""

    def encode(self, chunk):
        codes, codebook = torch_ops.quantize_int8(chunk, self.range_sigmas)
        return [codes.reshape(-1), codebook]

    def decode_add_(self, acc, payload):
        torch_ops.dequantize_add_(acc, payload[0], payload[1])

    def decode_add_encode(self, acc, payload):
        self.decode_add_(acc, payload)
        return self.encode(acc)

    def decode_(self, out, payload):
        torch_ops.dequantize_into_(out, payload[0], payload[1])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_replicas_on_different_quantizer_paths_stay_bit_identical(n):
    # Replicas may run different paths (native on one, torch or Triton on another): each chunk is reduced
    # along one chain and only its owner's bytes are decoded, so they agree whatever each path rounds.
    g = torch.Generator().manual_seed(n)
    inputs = [torch.randn(50_003, generator=g) * 10 ** (r % 3) for r in range(n)]
    codecs = [_TorchPathInt8() if r % 2 else Int8Codec() for r in range(n)]
    _assert_identical(_ring(inputs, codecs, segment_numel=10_000))
