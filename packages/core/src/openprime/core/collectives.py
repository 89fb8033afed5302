"""Collectives written once over any `Transport`: ring all-reduce and all-gather of small messages.

Ring all-reduce (Patarasuk and Yuan; the algorithm of INTELLECT-1's int8 all-reduce, paper section 2.3):
the tensor is cut into n chunks. In the reduce-scatter, for n-1 steps every rank sends one chunk to its
right neighbour and adds the chunk arriving from its left into its own copy; afterwards rank r holds
the complete sum of chunk (r+1) mod n. In the all-gather, for n-1 more steps, each rank forwards the
finished chunks around the ring. Each rank sends 2(n-1)/n of the tensor in all, whatever n is, which
is why the ring suits bandwidth-bound WAN links.

The owner of a finished chunk encodes it once and everyone else forwards those payload bytes
unchanged, so with a lossy codec every rank decodes identical bytes: replicas stay bit-identical.
The work happens in a copy; the caller's tensor is written only when every step succeeded, so a
failure (PeerFailure) leaves it exactly as it was and the caller may retry with the survivors.
"""

from __future__ import annotations

import msgpack
import torch

from openprime.core.codec import Codec, Float32Codec
from openprime.core.transport import Transport

# Tags keep the messages of different collectives apart on one transport.
TAG_ALL_REDUCE = 1
TAG_ALL_GATHER_SIZE = 2
TAG_ALL_GATHER_DATA = 3
TAG_STATE = 4

_FP32 = Float32Codec()
SEGMENT_NUMEL = 1 << 20  # 4 MiB of fp32 per message: large enough to stream, small enough to overlap


class _PayloadPool:
    """Receive buffers reused across the steps of one all-reduce (fresh memory costs page faults)."""

    def __init__(self, codec: Codec) -> None:
        self._codec = codec
        self._free: dict[tuple[int, int], list[torch.Tensor]] = {}

    def get(self, numel: int, parity: int) -> list[torch.Tensor]:
        key = (numel, parity)
        if key not in self._free:
            self._free[key] = self._codec.payload_like(numel)
        return self._free[key]


def ring_all_reduce(
    transport: Transport,
    tensor: torch.Tensor,
    *,
    deadline: float,
    codec: Codec = _FP32,
    tag: int = TAG_ALL_REDUCE,
    segment_numel: int = SEGMENT_NUMEL,
    restore_on_failure: bool = True,
) -> None:
    """Replace the 1-D fp32 CPU `tensor` by its sum over all ranks of the transport's group.

    Raises PeerFailure if a neighbour is lost or `deadline` passes; the tensor is then as it was, or,
    with `restore_on_failure=False` (for callers that recompute their input anyway, saving a copy of
    it), undefined.
    """
    if tensor.dtype != torch.float32 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"ring_all_reduce takes a contiguous 1-D float32 tensor, got {tensor.dtype} {tuple(tensor.shape)}"
        )
    n, r = transport.world_size, transport.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    work = tensor.clone() if restore_on_failure else tensor
    pool = _PayloadPool(codec)
    # n chunks (sizes differ by at most one element), each cut into segments that travel as separate
    # messages: while segment j is on the wire, segment j + 1 is being encoded, and a received segment is
    # decoded while the next one arrives (the double buffering of INTELLECT-1's int8 all-reduce).
    segments = [list(torch.split(chunk, segment_numel)) for chunk in torch.tensor_split(work, n)]

    # Reduce-scatter: at step s send chunk (r - s), receive chunk (r - s - 1) and add it in.
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        incoming = [pool.get(seg.numel(), j) for j, seg in enumerate(segments[recv_i])]
        receiving = [transport.irecv(left, tag, p, deadline=deadline) for p in incoming]
        sending = [transport.isend(right, tag, codec.encode(seg), deadline=deadline) for seg in segments[send_i]]
        for seg, payload, handle in zip(segments[recv_i], incoming, receiving, strict=True):
            handle.wait()
            codec.decode_add_(seg, payload)
        for handle in sending:
            handle.wait()

    # Now rank r owns the finished chunk (r + 1). Encode it once; decode it here too, so that the
    # owner holds exactly what the others will decode from the same bytes.
    own = (r + 1) % n
    payloads = [codec.encode(seg) for seg in segments[own]]
    for seg, payload in zip(segments[own], payloads, strict=True):
        codec.decode_(seg, payload)

    # All-gather: at step s forward the payloads of chunk (r + 1 - s), receive those of chunk (r - s).
    # fp32 is received straight into the result; a coded payload alternates between two buffer sets,
    # one being forwarded while the other fills.
    for s in range(n - 1):
        recv_i = (r - s) % n
        incoming = [codec.receive_into(seg) or pool.get(seg.numel(), len(segments[recv_i]) * (s % 2 + 1) + j)
                    for j, seg in enumerate(segments[recv_i])]
        receiving = [transport.irecv(left, tag, p, deadline=deadline) for p in incoming]
        sending = [transport.isend(right, tag, p, deadline=deadline) for p in payloads]
        for seg, payload, handle in zip(segments[recv_i], incoming, receiving, strict=True):
            handle.wait()
            codec.decode_(seg, payload)
        for handle in sending:
            handle.wait()
        payloads = incoming

    if work is not tensor:
        tensor.copy_(work)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def all_gather_bytes(transport: Transport, data: bytes, *, deadline: float) -> list[bytes]:
    """Every rank's `data`, indexed by rank, passed around the ring (n-1 steps of two messages)."""
    n, r = transport.world_size, transport.rank
    items: list[bytes] = [b""] * n
    items[r] = bytes(data)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        size_out = torch.tensor([len(items[send_i])], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        sending = transport.isend(right, TAG_ALL_GATHER_SIZE, [size_out], deadline=deadline)
        transport.irecv(left, TAG_ALL_GATHER_SIZE, [size_in], deadline=deadline).wait()
        sending.wait()
        data_in = torch.empty(int(size_in.item()), dtype=torch.uint8)
        sending = transport.isend(right, TAG_ALL_GATHER_DATA, [_bytes_tensor(items[send_i])], deadline=deadline)
        transport.irecv(left, TAG_ALL_GATHER_DATA, [data_in], deadline=deadline).wait()
        sending.wait()
        items[recv_i] = data_in.numpy().tobytes()
    return items


def all_gather_object(transport: Transport, obj: object, *, deadline: float) -> list[object]:
    """All-gather of a small msgpack-serialisable object (hashes, flags); never pickled."""
    packed = all_gather_bytes(transport, msgpack.packb(obj), deadline=deadline)
    return [msgpack.unpackb(p, raw=False) for p in packed]
