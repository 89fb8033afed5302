"""A Transport over Gloo point-to-point operations (torch.distributed.ProcessGroupGloo).

INTELLECT-1 ran its DiLoCo all-reduce over Gloo (paper section 2.3); here Gloo is one transport among
several behind the same interface. Each message is a fixed-size header buffer (prefix + msgpack,
padded to HEADER_BYTES) followed by one Gloo send per non-empty buffer, all under the message's tag;
Gloo keeps messages of one tag between two peers in order, which gives the ordering the contract asks.
Gloo errors (a reset connection, its own timeout) and our deadlines become `PeerFailure`. A Gloo pair
that timed out is closed by Gloo, so after a PeerFailure the group is rebuilt, never reused.

The group is built on a thread of its own, and the first operation waits for it. Gloo's constructor runs in C++
and nothing interrupts it: not a doomed try's abort (openprime.mesh.abort), which could only close the transport
once it existed, nor SIGTERM, whose Python handler waits for the main thread to come back. And it outlasts its
own timeout: with a peer that published its address and then stopped answering (a frozen process; a firewall that
drops packets), Gloo's handshake takes 5 x its timeout before it fails (measured with torch 2.13: 10.1 s for a
2 s timeout, 20.1 s for 4 s). Here an operation waits for the group at most `connect_timeout_s` from the
transport's creation, and `close()` from any thread fails it at once; a build that finishes after that is dropped.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from openprime.core.config import config, field, instance_of, positive_float, positive_int
from openprime.core.distributed import connect_store, gloo_group
from openprime.core.errors import FrameError, PeerFailure
from openprime.core.frames import decode_frame_header, encode_header
from openprime.core.transport import Handle, Rendezvous, Transport, as_bytes, remaining

HEADER_BYTES = 1024  # prefix + msgpack header, zero-padded: the receiver preallocates this much


@config
class GlooTransportConfig:
    """Settings of the Gloo transport."""

    hostname: str = field("127.0.0.1", doc="address Gloo binds and advertises for this process",
                          validator=instance_of(str))
    connect_timeout_s: float = field(60.0, doc="bound on building the Gloo group", validator=positive_float())
    max_frame_bytes: int = field(1 << 34, doc="largest message payload accepted (bytes)",
                                 validator=positive_int())


def _first_line(error: Exception) -> str:
    """Gloo's error messages run on with advice; their first line (at most 300 characters) says what happened."""
    return str(error).splitlines()[0][:300]


class _GlooHandle(Handle):
    def __init__(self, transport: GlooTransport, peer: int, works: list, deadline: float, nbytes: int,
                 *, sending: bool, header: torch.Tensor | None = None, sizes: list[int] | None = None,
                 tag: int = 0) -> None:
        self._t, self._peer, self._works, self._deadline = transport, peer, works, deadline
        self._nbytes, self._sending, self._header, self._sizes, self._tag = nbytes, sending, header, sizes, tag
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for i, work in enumerate(self._works):
            left = remaining(self._deadline)
            if left <= 0:
                self._t._fail(self._peer, "deadline passed")
            try:
                work.wait(datetime.timedelta(seconds=max(left, 1e-3)))
            except RuntimeError as e:
                self._t._fail(self._peer, "transport closed by this process while waiting (an aborted try)"
                              if self._t._closed else f"gloo: {_first_line(e)}")
            finally:
                self._t._settled(work)
            if i == 0 and self._header is not None:
                self._check_header()
        self._done = True
        if self._sending:
            self._t._count(sent=self._nbytes)
        else:
            self._t._count(received=self._nbytes)

    def _check_header(self) -> None:
        try:
            header = decode_frame_header(self._header.numpy().tobytes(), self._peer,
                                         max_frame_bytes=self._t.config.max_frame_bytes)
        except FrameError:
            self._t._broken = True
            raise
        if header.tag != self._tag or list(header.sizes) != self._sizes:
            self._t._broken = True
            raise FrameError(self._peer, f"expected tag {self._tag} with buffer sizes {self._sizes}, "
                                         f"got tag {header.tag} with sizes {list(header.sizes)}")


class GlooTransport(Transport):
    """Transport over a ProcessGroupGloo built on the group's own store prefix."""

    def __init__(self, rendezvous: Rendezvous, rank: int, world_size: int, config: GlooTransportConfig) -> None:
        super().__init__(rank, world_size)
        self.config = config
        self._closed = False
        self._broken = False
        self._lock = threading.Lock()
        self._in_flight: set = set()  # posted Gloo works not yet waited on: what close() must fail
        self._pg: dist.ProcessGroupGloo | None = None
        self._build_error: str | None = None
        self._build_deadline = time.monotonic() + config.connect_timeout_s
        self._settled_group = threading.Event()  # the group is built, or its build failed, or the transport closed
        threading.Thread(target=self._build, args=(rendezvous,), name=f"openprime-gloo-build-r{rank}",
                         daemon=True).start()

    def _build(self, rendezvous: Rendezvous) -> None:
        """Build the Gloo group (on its own thread: see the module docstring)."""
        try:
            store = connect_store(rendezvous, self.config.connect_timeout_s, suffix="/gloo")
            pg = gloo_group(store, self.rank, self.world_size, timeout_s=self.config.connect_timeout_s,
                            host=self.config.hostname)
        except PeerFailure as e:  # connect_store's bound: a store that accepts and never answers (found 2026-12-07:
            # uncaught, it ended this thread with a traceback on the node's stderr)
            self._build_error = e.reason
        except RuntimeError as e:  # Gloo's errors, and the store's (DistStoreError is a RuntimeError)
            self._build_error = _first_line(e)
        else:
            with self._lock:
                if not self._closed:
                    self._pg = pg
            # Closed meanwhile: `pg` goes out of scope here, and Gloo closes its pairs when the group is destroyed.
        self._settled_group.set()

    def _group(self, peer: int, deadline: float) -> dist.ProcessGroupGloo:
        """The built group, once it is: waited for until `deadline` and at most `connect_timeout_s` from this
        transport's creation, and failed at once by close()."""
        self._settled_group.wait(max(0.0, min(deadline, self._build_deadline) - time.monotonic()))
        if self._pg is not None:
            return self._pg
        others = tuple(r for r in range(self.world_size) if r != self.rank)
        if self._closed:
            raise PeerFailure(peer, "transport is closed")
        self._broken = True
        if self._build_error is not None:
            raise PeerFailure(others, f"could not build the Gloo group: {self._build_error}")
        if time.monotonic() >= self._build_deadline:
            raise PeerFailure(others, f"the Gloo group was not built within connect_timeout_s="
                                      f"{self.config.connect_timeout_s:g}: a peer did not come, or came and does not "
                                      f"answer (a frozen process, or a firewall that drops its packets)")
        raise PeerFailure(peer, "deadline passed while the Gloo group was being built")

    def frame_bytes(self, tag: int, sizes: Sequence[int]) -> int:
        return HEADER_BYTES + sum(sizes)

    def _fail(self, peer: int, reason: str) -> None:
        self._broken = True
        raise PeerFailure(peer, reason)

    def _ready(self, peer: int) -> None:
        self._check_peer(peer)
        if self._closed:
            raise PeerFailure(peer, "transport is closed")
        if self._broken:
            raise PeerFailure(peer, "transport is broken by an earlier failure; rebuild the group")

    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        self._ready(peer)
        views = [as_bytes(b) for b in buffers]
        sizes = [v.numel() for v in views]
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        encoded = encode_header(tag, sizes)
        if len(encoded) > HEADER_BYTES:
            raise ValueError(f"too many buffers in one message for the Gloo header ({len(sizes)})")
        header[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        works = self._start("send", peer, tag, [header, *(v for v in views if v.numel())], deadline)
        return _GlooHandle(self, peer, works, deadline, self.frame_bytes(tag, sizes), sending=True)

    def irecv(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        self._ready(peer)
        views = [as_bytes(b) for b in buffers]
        sizes = [v.numel() for v in views]
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        works = self._start("recv", peer, tag, [header, *(v for v in views if v.numel())], deadline)
        return _GlooHandle(self, peer, works, deadline, self.frame_bytes(tag, sizes), sending=False,
                           header=header, sizes=sizes, tag=tag)

    def _start(self, op: str, peer: int, tag: int, buffers: list[torch.Tensor], deadline: float) -> list:
        """Post Gloo's send or recv (`op`) of each buffer, once the group is built. Gloo raises at once on a pair it
        already saw closed (a peer that left or died before this call): that is a PeerFailure like any other, not a
        crash. Posted under the lock that close() takes: a close from another thread (a doomed try's abort) either
        fails these works or comes first, and then they are not posted (before, the group could be gone)."""
        group = self._group(peer, deadline)
        with self._lock:
            if self._closed:
                raise PeerFailure(peer, "transport is closed")
            try:
                works = [getattr(group, op)([b], peer, tag) for b in buffers]
            except RuntimeError as e:
                self._fail(peer, f"gloo: {_first_line(e)}")
                raise  # unreachable: _fail raises
            self._in_flight.update(works)
        return works

    def _settled(self, work) -> None:
        with self._lock:
            self._in_flight.discard(work)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Emptied, not only read: Gloo closes its pairs when the group is destroyed, which is when nothing holds
            # it or a work of it. A send that completed but was never waited on (a ring step's, when its receive
            # failed first) kept the group alive here until this transport was dropped at the next view, and its
            # right-hand peer, waiting on this process, waited until then (tools/chaos.py seed 34: 20 s, then that
            # peer was evicted as a straggler).
            pending, self._in_flight = list(self._in_flight), set()
        self._settled_group.set()  # an operation waiting for the group to be built fails now
        # Another thread may be waiting on an operation (closed from a watcher: an aborted try). Neither abort() nor
        # shutdown() of the group wakes it, but a wait on a pending operation that times out makes Gloo fail every
        # pending operation of the group and close its pairs (gloo's UnboundBuffer: "let all pairs in the transport
        # context know about this application side timeout"): the waiter and the peers waiting on us fail now.
        for work in pending:
            try:
                work.wait(datetime.timedelta(milliseconds=1))
            except RuntimeError:
                break  # one timeout closed them all
        self._pg = None


def create_gloo_transport(rendezvous: Rendezvous, rank: int, world_size: int,
                          config: GlooTransportConfig | None = None) -> GlooTransport:
    """The TransportFactory of this package (use functools.partial to bind a config)."""
    return GlooTransport(rendezvous, rank, world_size, config or GlooTransportConfig())


