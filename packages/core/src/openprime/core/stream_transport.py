"""What the stream transports (raw TCP and ZeroMQ) share: their state per peer and their sending side.

Both keep, for each peer, an `OutLink`: `num_connections` connections opened lazily (or early, in the
background, right after the transport is made), one `ConnectionWriter` thread each, and the sequence
numbers of what was sent under each tag. A send takes the link (connecting it first if it is not usable),
cuts the message into frames and deals them over the writers (outbox.py); a writer that fails marks its
generation of the link broken, and the next send reconnects as a new generation. Receives fill a Mailbox
(mailbox.py). What differs is below this class: how a connection is made and authenticated (`_connect`), how
a frame is written, how a peer that cannot be reached is reported (`_lose_peer`), and how frames are read;
each transport's module says how.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch

from openprime.core.distributed import connect_store
from openprime.core.errors import PeerFailure
from openprime.core.mailbox import Mailbox, MailboxReceives
from openprime.core.outbox import ConnectionWriter, deal_message, framed_bytes, now
from openprime.core.shaping import LinkShaper
from openprime.core.streams import StreamTransportConfig
from openprime.core.transport import Handle, Rendezvous, Transport, as_bytes, remaining


class OutLink:
    """This rank's connections to one peer, and the sequence numbers of what it sent there."""

    def __init__(self, shaper: LinkShaper) -> None:
        self.lock = threading.Lock()
        self.shaper = shaper
        self.writers: list[ConnectionWriter] = []
        self.next_seq: dict[int, int] = defaultdict(int)
        self.generation = 0
        self.broken = True  # nothing connected yet
        self.turn = 0

    @property
    def usable(self) -> bool:
        """Whether a send may be dealt to the writers; if not, the next send reconnects."""
        return not self.broken


class StreamTransport(MailboxReceives, Transport):
    """A Transport that sends chunked frames over several connections per peer; see the module docstring.

    A subclass makes its listener in its own constructor after this one, then calls `_connect_early()`, and
    implements `_connect` (under the link's lock: (re)open the link's connections as its next generation and
    give it its writers, or raise PeerFailure), `_lose_peer` and `close`.
    """

    def __init__(self, rendezvous: Rendezvous, rank: int, world_size: int, config: StreamTransportConfig, *,
                 kind: str, new_link: Callable[[LinkShaper], OutLink]) -> None:
        super().__init__(rank, world_size)
        self.config = config
        self.kind = kind  # "tcp", "zmq": in the names of its threads, its logger and its rendezvous keys
        self._log = logging.getLogger(f"openprime.transports.{kind}")
        self.refusals: list[tuple[str, str]] = []  # (address, reason) of every refused connection or frame
        self._secret = config.auth.load_secret()
        self._incarnation = uuid.uuid4().hex
        self._mailbox = Mailbox(max_unexpected_bytes=config.max_unexpected_bytes)
        self._closed = threading.Event()
        self._out = {p: new_link(LinkShaper(config.shaping)) for p in range(world_size) if p != rank}
        self._store = connect_store(rendezvous, config.connect_timeout_s, suffix=f"/{kind}")

    @property
    def bytes_received(self) -> int:
        return self._mailbox.bytes_received

    # ------------------------------------------------------------------ to be provided

    def _connect(self, peer: int, link: OutLink, deadline: float) -> None:
        raise NotImplementedError

    def _lose_peer(self, peer: int, reason: str) -> None:
        """Fail what waits on `peer`: connecting to it failed. Not while it has a connection to this rank: what it
        sent comes over that, and its death or goodbye is seen there (a refused connect to a peer that sent, then
        closed, failed receives of messages still in flight)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ sending

    def _connect_early(self) -> None:
        """Connect to every peer now, in the background, as Gloo does: a peer that dies later is then seen at
        once (its connections to us end without a goodbye), and one that cannot be reached (and has not connected to us)
        fails our receives."""
        for peer in self._out:
            threading.Thread(target=self._connect_in_background, args=(peer,), daemon=True,
                             name=f"{self.kind}-connect-{self.rank}-{peer}").start()

    def _connect_in_background(self, peer: int) -> None:
        try:
            self._connected(peer, now() + self.config.connect_timeout_s)
        except PeerFailure as e:
            if not self._closed.is_set():
                self._lose_peer(peer, e.reason)

    def _connected(self, peer: int, deadline: float) -> OutLink:
        self._check_peer(peer)
        if self._closed.is_set():
            raise PeerFailure(peer, "transport is closed")
        link = self._out[peer]
        with self._holding(link, peer, deadline):
            if self._closed.is_set():  # closed by another thread since the check above: do not reconnect
                raise PeerFailure(peer, "transport is closed")
            if not link.usable:
                self._connect(peer, link, deadline)
        return link

    @staticmethod
    @contextlib.contextmanager
    def _holding(link: OutLink, peer: int, deadline: float) -> Iterator[None]:
        """Hold the link's lock, waiting for it until `deadline` at most: another thread holds it through a whole
        connect (the background one: up to connect_timeout_s, to a peer that accepts and never answers, e.g. a
        frozen process), and a send waited that out instead of failing at its own deadline."""
        if not link.lock.acquire(timeout=remaining(deadline)):
            raise PeerFailure(peer, "deadline passed while another thread was connecting to the peer")
        try:
            yield
        finally:
            link.lock.release()

    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        link = self._connected(peer, deadline)
        views = [as_bytes(b) for b in buffers]
        with self._holding(link, peer, deadline):
            # Closed since _connected returned (a doomed try's abort, from another thread), or a writer failed. A
            # usable link has its writers: they are dropped and made only together with `broken`, under this lock.
            if not link.usable:
                raise PeerFailure(peer, "transport is closed" if self._closed.is_set() else "connection lost")
            seq = link.next_seq[tag]
            link.next_seq[tag] = seq + 1
            handle, link.turn = deal_message(link.writers, link.turn, views, peer=peer, tag=tag, seq=seq,
                                             chunk_bytes=self.config.effective_chunk_bytes, deadline=deadline,
                                             on_done=lambda framed: self._count(sent=framed))
        return handle

    def frame_bytes(self, tag: int, sizes: Sequence[int]) -> int:
        return framed_bytes(sizes, tag=tag, chunk_bytes=self.config.effective_chunk_bytes)

    def _send_failed(self, peer: int, generation: int, error: BaseException) -> None:
        """A writer of `generation` of the link to `peer` failed: the next send reconnects. A socket's error (the
        peer died or closed) is expected; anything else is logged."""
        if not isinstance(error, (PeerFailure, OSError)):
            self._log.warning("rank %d: sending to rank %d failed: %r", self.rank, peer, error)
        link = self._out[peer]
        with link.lock:
            if link.generation == generation:
                link.broken = True

    # ------------------------------------------------------------------ receiving

    def _receivable(self, peer: int) -> None:  # irecv: MailboxReceives
        self._check_peer(peer)
        if self._closed.is_set():
            raise PeerFailure(peer, "transport is closed")

    def _refuse(self, addr: str, reason: str) -> None:
        self.refusals.append((addr, reason))
        self._log.warning("rank %d refused %s: %s", self.rank, addr, reason)
