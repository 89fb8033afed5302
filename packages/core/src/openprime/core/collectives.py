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

With fp32 no payload is decoded: the reduce-scatter receives with `Transport.irecv_add`, which adds each
arriving chunk into the work tensor (ZeroMQ straight from its own message memory, saving a copy), and
the all-gather receives straight into it.

The tensor may live on an accelerator (DiLoCo's pseudo-gradient computed on the GPU): the codec then
runs there, wrapped in a DeviceStagingCodec, and only payloads pass through host memory (for int8, the
codes: a quarter of the fp32 bytes). The transports only ever see host buffers.
"""

from __future__ import annotations

import msgpack
import torch

from openprime.core.codec import Codec, Float32Codec, for_device
from openprime.core.transport import Transport

# Tags keep the messages of different collectives apart on one transport.
TAG_ALL_REDUCE = 1
TAG_ALL_GATHER_SIZE = 2
TAG_ALL_GATHER_DATA = 3

_FP32 = Float32Codec()
SEGMENT_NUMEL = 1 << 20  # 4 MiB of fp32 per message: large enough to stream, small enough to overlap


class RingBuffers:
    """Receive buffers of the ring all-reduce, reused across its steps and, if the caller keeps this object,
    across calls: fresh memory costs a page fault per 4 KiB (0.5-1 us each on this VM, 2026-12-03: filling a
    fresh 64 MiB took 13-25 ms where refilling it took 4-15 ms), a sizeable part of a loopback transfer.
    Buffers that a call did not use (the group size or codec changed) are released at its end."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str, int, int], list[torch.Tensor]] = {}
        self._used: set[tuple[int, str, int, int]] = set()

    def get(self, codec: Codec, numel: int, key: int) -> list[torch.Tensor]:
        entry = (id(type(codec)), codec.name, numel, key)  # the name tells apart what a DeviceStagingCodec wraps
        if entry not in self._free:
            self._free[entry] = codec.payload_like(numel)
        self._used.add(entry)
        return self._free[entry]

    def clear(self) -> None:
        self._free, self._used = {}, set()

    def release_unused(self) -> None:
        self._free = {k: v for k, v in self._free.items() if k in self._used}
        self._used = set()


def ring_all_reduce(
    transport: Transport,
    tensor: torch.Tensor,
    *,
    deadline: float,
    codec: Codec = _FP32,
    tag: int = TAG_ALL_REDUCE,
    segment_numel: int = SEGMENT_NUMEL,
    restore_on_failure: bool = True,
    buffers: RingBuffers | None = None,
) -> None:
    """Replace the 1-D fp32 `tensor` by its sum over all ranks of the transport's group.

    On an accelerator the codec runs on the tensor's device and its payloads are staged through host
    memory (`codec.for_device`); all ranks' results stay bit-identical whichever device each used.

    Raises PeerFailure if a neighbour is lost or `deadline` passes; the tensor is then as it was, or,
    with `restore_on_failure=False` (for callers that recompute their input anyway, saving a copy of
    it), undefined. A caller that all-reduces repeatedly (DiLoCo, at every outer step) passes the same
    `buffers` each time so that the receive buffers are not allocated again.
    """
    if tensor.dtype != torch.float32 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"ring_all_reduce takes a contiguous 1-D float32 tensor, got {tensor.dtype} {tuple(tensor.shape)}"
        )
    n, _r = transport.world_size, transport.rank
    if n == 1:
        return
    codec = for_device(codec, tensor.device)
    work = tensor.clone() if restore_on_failure else tensor
    pool = buffers if buffers is not None else RingBuffers()
    try:
        _Ring(transport, codec, tag, deadline, work, segment_numel, pool).run()
    except BaseException:
        pool.clear()  # a failed transfer may still write into them: the next call gets fresh ones
        raise
    pool.release_unused()
    if work is not tensor:
        tensor.copy_(work)


class _Ring:
    """One ring all-reduce, pipelined segment by segment.

    The n chunks are cut into segments that travel as separate messages. A segment moves on as soon as
    it can: in the reduce-scatter, segment j of the chunk received at step s is added in, encoded and
    sent on as segment j of step s + 1 while segment j + 1 is still arriving; at the last step the owner
    encodes its finished chunk the same way and its segments start the all-gather at once; in the
    all-gather each received segment is forwarded unchanged the moment it arrives. Receives are posted
    one step ahead, so a message finds its buffer waiting.
    """

    def __init__(self, transport: Transport, codec: Codec, tag: int, deadline: float, work: torch.Tensor,
                 segment_numel: int, pool: RingBuffers) -> None:
        self.t, self.codec, self.tag, self.deadline = transport, codec, tag, deadline
        self.n, self.r = transport.world_size, transport.rank
        self.right, self.left = (self.r + 1) % self.n, (self.r - 1) % self.n
        self.segments = [list(torch.split(chunk, segment_numel)) for chunk in torch.tensor_split(work, self.n)]
        self.pool = pool
        self.rs_sends: list[list] = [[] for _ in range(self.n)]  # reduce-scatter sends, by step
        self.ag_sends: list = []

    def _post(self, chunk: int, key: int, *, into_result: bool) -> list[tuple[list[torch.Tensor] | None, object]]:
        """Receives for the segments of `chunk`: into the result (an all-gather of fp32), added into it (the
        reduce-scatter of fp32: the payload is None, nothing is left to decode), or into a payload buffer."""
        posted = []
        for j, seg in enumerate(self.segments[chunk]):
            values = self.codec.receive_into(seg)
            if values is not None and into_result:
                posted.append((values, self.t.irecv(self.left, self.tag, values, deadline=self.deadline)))
                continue
            payload = self.pool.get(self.codec, seg.numel(), key + j)
            if values is not None:
                adding = self.t.irecv_add(self.left, self.tag, seg, scratch=payload[0], deadline=self.deadline)
                posted.append((None, adding))
            else:
                posted.append((payload, self.t.irecv(self.left, self.tag, payload, deadline=self.deadline)))
        return posted

    def _send(self, payload: list[torch.Tensor], into: list) -> None:
        into.append(self.t.isend(self.right, self.tag, payload, deadline=self.deadline))

    def _post_gather(self, s: int) -> list[tuple[list[torch.Tensor], object]]:
        """Receives of all-gather step s: chunk (r - s), which left this rank at reduce-scatter step s."""
        chunk = (self.r - s) % self.n
        if self.codec.receive_into(self.segments[chunk][0]) is not None:
            for handle in self.rs_sends[s]:  # an fp32 result is received into memory that send may still read
                handle.wait()
        return self._post(chunk, 1_000_000 * (s + 2), into_result=True)

    def run(self) -> None:
        n, r = self.n, self.r
        # Reduce-scatter: step s sends chunk (r - s) and receives chunk (r - s - 1), adding it in.
        incoming = self._post((r - 1) % n, 0, into_result=False)
        for seg in self.segments[r]:
            self._send(self.codec.encode(seg), self.rs_sends[0])
        for s in range(n - 1):
            last = s == n - 2
            following = self._post_gather(0) if last else self._post((r - s - 2) % n, 1_000_000 * ((s + 1) % 2),
                                                                       into_result=False)
            for seg, (payload, handle) in zip(self.segments[(r - s - 1) % n], incoming, strict=True):
                handle.wait()
                out = self.codec.encode(seg) if payload is None else self.codec.decode_add_encode(seg, payload)
                self._send(out, self.ag_sends if last else self.rs_sends[s + 1])
                if last:  # rank r owns this finished chunk: encode it once and hold exactly what others decode
                    self.codec.decode_(seg, out)  # after the send is queued: both only read `out`
            incoming = following
        # All-gather: step s receives chunk (r - s) and forwards each segment unchanged at once.
        for s in range(n - 1):
            following = self._post_gather(s + 1) if s < n - 2 else []
            for seg, (payload, handle) in zip(self.segments[(r - s) % n], incoming, strict=True):
                handle.wait()
                if s < n - 2:  # forwarded before it is decoded here: the next rank need not wait for that
                    self._send(payload, self.ag_sends)
                self.codec.decode_(seg, payload)
            incoming = following
        for handle in [h for step in self.rs_sends for h in step] + self.ag_sends:
            handle.wait()


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
