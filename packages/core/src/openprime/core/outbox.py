"""The send side of the stream transports (TCP, ZeroMQ): chunking, striping, shaping, completion.

A message (a list of buffers) is cut into chunks of at most `chunk_bytes` that never span two buffers
(so the receiver writes each chunk into one contiguous slice), numbered by the message's `seq` for
its (peer, tag). The chunks are dealt round-robin over the peer's connections, each served by one
`ConnectionWriter` thread, so a large message travels over `num_connections` TCP streams at once,
the way PRIME's parallel rings and PCCL's connection pools multiplied WAN bandwidth. A `SendHandle`
completes when every chunk has been handed to the operating system.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from openprime.core.errors import OpenPrimeError, PeerFailure
from openprime.core.frames import encode_header
from openprime.core.shaping import LinkShaper
from openprime.core.transport import Handle, remaining


class SendHandle(Handle):
    """Completion of one message: all its chunks written, or the first failure."""

    def __init__(self, peer: int, num_chunks: int, deadline: float, on_done: Callable[[], None]) -> None:
        self.peer, self._left, self._deadline, self._on_done = peer, num_chunks, deadline, on_done
        self._cond = threading.Condition()
        self.error: OpenPrimeError | None = None

    def chunk_done(self) -> None:
        with self._cond:
            self._left -= 1
            if self._left == 0 and self.error is None:
                self._on_done()
                self._cond.notify_all()

    def fail(self, error: OpenPrimeError) -> None:
        with self._cond:
            if self.error is None and self._left > 0:
                self.error = error
                self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._left > 0 and self.error is None:
                left = remaining(self._deadline)
                if left <= 0:
                    self.error = PeerFailure(self.peer, "deadline passed while sending")
                    break
                self._cond.wait(left)
            if self.error is not None:
                raise self.error


@attrs.frozen
class Chunk:
    """One data frame waiting for its connection: header bytes plus a slice of the user's buffer."""

    header: bytes
    payload: torch.Tensor  # uint8 view into the user's buffer: no copy
    handle: SendHandle
    queued_at: float
    deadline: float

    @property
    def framed_bytes(self) -> int:
        return len(self.header) + self.payload.numel()


def plan_chunks(views: Sequence[torch.Tensor], *, tag: int, seq: int,
                chunk_bytes: int) -> list[tuple[bytes, torch.Tensor]]:
    """(header, payload slice) of every chunk of a message; an empty message is one empty chunk."""
    sizes = [v.numel() for v in views]
    chunks = []
    start = 0
    for view in views:
        for lo in range(0, view.numel(), chunk_bytes):
            piece = view[lo : lo + chunk_bytes]
            chunks.append((encode_header(tag, sizes, seq=seq, offset=start + lo, length=piece.numel()), piece))
        start += view.numel()
    if not chunks:
        chunks.append((encode_header(tag, sizes, seq=seq, offset=0, length=0), torch.empty(0, dtype=torch.uint8)))
    return chunks


def deal_message(writers: Sequence[ConnectionWriter], turn: int, views: Sequence[torch.Tensor], *, peer: int,
                 tag: int, seq: int, chunk_bytes: int, deadline: float,
                 on_done: Callable[[int], None]) -> tuple[SendHandle, int]:
    """Cut a message into chunks and deal them round-robin over a peer's writers, starting at `turn`.

    Returns the message's handle (calling `on_done(framed bytes)` once every chunk is written) and the
    next turn. The caller holds the lock that orders its (peer, tag) sequence numbers.
    """
    planned = plan_chunks(views, tag=tag, seq=seq, chunk_bytes=chunk_bytes)
    framed = sum(len(h) + p.numel() for h, p in planned)
    handle = SendHandle(peer, len(planned), deadline, on_done=lambda: on_done(framed))
    queued_at = now()
    for j, (header, payload) in enumerate(planned):
        writers[(turn + j) % len(writers)].put(
            Chunk(header=header, payload=payload, handle=handle, queued_at=queued_at, deadline=deadline))
    return handle, turn + len(planned)


def framed_bytes(sizes: Sequence[int], *, tag: int, chunk_bytes: int) -> int:
    """Bytes on the wire for a message with buffer `sizes`: its chunks' headers plus the payload."""
    views = [torch.empty(s, dtype=torch.uint8) for s in sizes]
    return sum(len(h) + p.numel() for h, p in plan_chunks(views, tag=tag, seq=0, chunk_bytes=chunk_bytes))


class ConnectionWriter:
    """A thread writing queued chunks, in order, to one connection through the peer's shaped link."""

    def __init__(self, name: str, write: Callable[[Chunk], None], shaper: LinkShaper,
                 on_error: Callable[[BaseException], None]) -> None:
        self._write, self._shaper, self._on_error = write, shaper, on_error
        self._queue: queue.Queue[Chunk | None] = queue.Queue()
        self._failed: OpenPrimeError | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, chunk: Chunk) -> None:
        if self._failed is not None:
            chunk.handle.fail(self._failed)
        else:
            self._queue.put(chunk)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Finish the queued chunks and end the thread; False if it is still writing after `timeout_s`."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self._failed is not None:
                chunk.handle.fail(self._failed)
                continue
            if chunk.handle.error is not None:
                continue  # the message already failed elsewhere; its other chunks are moot
            try:
                if remaining(chunk.deadline) <= 0:
                    raise PeerFailure(chunk.handle.peer, "deadline passed before the chunk could be sent")
                self._shaper.hold(chunk.queued_at)
                self._shaper.pace(chunk.framed_bytes)
                self._write(chunk)
                chunk.handle.chunk_done()
            except BaseException as e:  # a broken connection fails this and every later chunk
                error = e if isinstance(e, PeerFailure) else PeerFailure(chunk.handle.peer, f"send failed: {e}")
                self._failed = error
                chunk.handle.fail(error)
                self._on_error(e)


def now() -> float:
    return time.monotonic()
