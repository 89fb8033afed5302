"""A Transport over ZeroMQ, for networks where Gloo and VPNs get in the way (DESIGN.md, "Transport").

INTELLECT-1's Tailscale VPN became its bottleneck (paper, section 3.1); this transport needs one open
TCP port per node. Each rank binds one ROUTER socket and publishes its endpoint in the rendezvous
store (receiver.py serves it). To send to a peer it opens `num_connections` DEALER sockets to the
peer's ROUTER at construction, in the background, each its own TCP connection with a routing id naming
(rank, connection, generation, incarnation); proves itself on each (run id, and an HMAC
challenge-response when the site has a shared secret); and from then on one `ConnectionWriter` thread
per DEALER writes data frames, large messages striped over them (openprime.core.outbox), paced by the
link's WAN shaping. A DEALER is only ever touched by one thread at a time: the connecting thread
during the handshake, then its writer, then the closing thread (pyzmq sockets are not thread-safe).

Sends are zero-copy: the payload part is the caller's tensor memory, and a chunk counts as sent when
libzmq releases it (its MessageTracker), i.e. once it has been written to the kernel, the same point
at which the TCP transport's sendall returns; the caller may then reuse its buffer.

ZeroMQ reconnects silently by default; here automatic reconnection is off, so a connection that
breaks stays broken: its writer fails, and the next send reconnects as a new generation, which the
receiver treats as a reset of that peer's streams (the TCP transport's semantics). A peer that
restarts comes back as a new incarnation the same way.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from openprime.core import auth
from openprime.core.distributed import peer_address
from openprime.core.errors import OpenPrimeError, PeerFailure
from openprime.core.frames import encode_control
from openprime.core.outbox import Chunk, ConnectionWriter, now
from openprime.core.shaping import LinkShaper
from openprime.core.stream_transport import OutLink, StreamTransport
from openprime.core.streams import StreamTransportConfig
from openprime.core.transport import Handle, Rendezvous, check_add_buffers, remaining
from openprime.transports.zmq.allocator import keep_freed_memory
from openprime.transports.zmq.receiver import Receiver
from openprime.transports.zmq.wire import BYE, CONTROL_MAX_BYTES, configure, endpoint, parse_control
from openprime.transports.zmq.zerocopy import ready_zero_copy

log = logging.getLogger("openprime.transports.zmq")
ZmqTransportConfig = StreamTransportConfig
SLICE_S = 0.05  # every wait below is cut into slices of this length to look at close and abort flags
LOST_AFTER_S = 1.0  # a DEALER with no room for one more message has lost its only connection
DRAIN_S = 2.0  # what close() gives queued chunks to leave before it aborts them
BYE_LINGER_MS = 1000  # how long libzmq may keep trying to deliver a goodbye after close
SEND_HWM = 16


class _OutConn:
    """One DEALER to a peer and the lock that hands it from its writer to whoever closes it."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.abort = threading.Event()
        self.closed = False


class _OutLink(OutLink):
    """OutLink with the link's DEALERs, and the generation the receiver thread saw one of them disconnect in."""

    def __init__(self, shaper: LinkShaper) -> None:
        super().__init__(shaper)
        self.conns: list[_OutConn] = []
        self.lost_generation = 0  # set by the receiver thread when a DEALER of that generation disconnects

    @property
    def usable(self) -> bool:
        return not self.broken and self.lost_generation != self.generation


class ZmqTransport(StreamTransport):
    """Transport over ZeroMQ with parallel connections per peer; see the module docstring."""

    def __init__(self, rendezvous: Rendezvous, rank: int, world_size: int, config: StreamTransportConfig) -> None:
        super().__init__(rendezvous, rank, world_size, config, kind="zmq", new_link=_OutLink)
        self._close_lock = threading.Lock()
        keep_freed_memory()  # libzmq's receive buffers would otherwise come back as fresh pages (allocator.py)
        ready_zero_copy()  # before any writer thread: pyzmq's lazy set-up of tracked sends races (zerocopy.py)
        # One I/O thread: the receiver's reasoning about connection ends relies on one thread emitting a
        # connection's accept event and pushing its messages (receiver.py); it moves several GB/s.
        self._ctx = zmq.Context(io_threads=1)
        self._receiver = self._listen()
        self.endpoint = endpoint(config.hostname, self._receiver.port)
        self._connect_early()

    def _listen(self) -> Receiver:
        """Bind the ROUTER, start its thread and publish its endpoint; on failure leave nothing behind."""
        try:
            receiver = Receiver(self._ctx, self.config, rank=self.rank, world_size=self.world_size,
                                mailbox=self._mailbox, secret=self._secret, refuse=self._refuse,
                                link_lost=self._link_lost)
        except BaseException:
            self._ctx.term()  # the receiver closed its sockets
            raise
        receiver.start()
        try:
            self._store.set(f"addr/{self.rank}", endpoint(self.config.hostname, receiver.port))
        except BaseException:
            self._closed.set()
            receiver.stop(timeout_s=2.0)
            _terminate(self._ctx, timeout_s=1.0)
            raise
        return receiver

    # ------------------------------------------------------------------ sending (isend: StreamTransport)

    def _connect(self, peer: int, link: _OutLink, deadline: float) -> None:
        """(Re)open all connections to `peer` as a new generation. Holds link.lock."""
        self._drop(link, drain_deadline=now())
        link.generation += 1
        link.next_seq.clear()
        deadline = min(deadline, now() + self.config.connect_timeout_s)
        target = "?"
        socks: list[zmq.Socket] = []
        addressed = False  # the peer published its address: a failure from here on is the link's (unreachable)
        try:
            target = peer_address(self._store, peer, deadline=deadline, closed=self._closed)
            addressed = True
            for conn in range(self.config.num_connections):
                socks.append(self._dealer(peer, conn, link.generation))
            self._client_handshake(socks, target, peer, link.generation, deadline)
        except (OSError, OpenPrimeError, RuntimeError, zmq.ZMQError) as e:
            for sock in socks:
                _close_quietly(sock)
            if isinstance(e, auth.Refused):  # the peer refused us, or failed to prove it holds the secret
                self._refuse(target, str(e))
            reason = e.reason if isinstance(e, PeerFailure) else str(e)
            if addressed and not self._closed.is_set():
                self._reached(peer, False)
            raise PeerFailure(peer, f"cannot connect to {target}: {reason}") from None
        self._reached(peer, True)
        for conn, sock in enumerate(socks):
            out = _OutConn(sock)
            link.conns.append(out)
            link.writers.append(ConnectionWriter(
                f"zmq-send-{self.rank}-{peer}-{conn}", self._writer_for(out, peer), link.shaper,
                on_error=lambda e, p=peer, g=link.generation: self._send_failed(p, g, e)))
        link.broken = False

    def _dealer(self, peer: int, conn: int, generation: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        configure(sock, self.config.hostname)
        ident = f"r{self.rank}c{conn}g{generation}i{self._incarnation[:12]}"
        sock.setsockopt(zmq.ROUTING_ID, ident.encode())
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # a broken connection stays broken; see the module docstring
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)  # only handshake replies come back
        # Every payload zero-copy, so that every send is tracked and the writer waits for it to leave (_await_sent):
        # one message in flight per DEALER, which `_send_chunk`'s "no room: connection lost" relies on. Payloads under
        # pyzmq's threshold (64 KiB) were copied and their trackers done at once: up to SNDHWM of them queued, and
        # a peer paused for a second (a GC pause, a descheduled VM) read as dead (found 2026-12-07 by review).
        sock.copy_threshold = 0
        return sock

    def _client_handshake(self, socks: list[zmq.Socket], target: str, peer: int, generation: int,
                          deadline: float) -> None:
        """Run the handshake on every connection at once: one round trip (two with a secret), not one each."""
        events = zmq.EVENT_CLOSED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
        monitors = [s.get_monitor_socket(events) for s in socks]
        done = False
        try:
            nonces = []
            for conn, sock in enumerate(socks):
                sock.connect(target)
                nonces.append(auth.new_nonce())
                sock.send(encode_control(auth.hello(self.config.auth, rank=self.rank, to=peer, conn=conn,
                                                    incarnation=self._incarnation, generation=generation,
                                                    nonce=nonces[-1])), zmq.NOBLOCK)
            answered = []
            for sock, monitor, nonce in zip(socks, monitors, nonces, strict=True):
                reply = self._await_control(sock, monitor, peer, deadline)
                proof = auth.client_answer(reply, auth=self.config.auth, secret=self._secret, rank=self.rank,
                                           nonce=nonce)
                if proof is not None:
                    sock.send(encode_control(proof), zmq.NOBLOCK)
                    answered.append((sock, monitor, nonce))
            for sock, monitor, nonce in answered:
                auth.client_answer(self._await_control(sock, monitor, peer, deadline), auth=self.config.auth,
                                   secret=None, rank=self.rank, nonce=nonce)
            done = True
        finally:
            for sock, monitor in zip(socks, monitors, strict=True):
                if done:  # the receiver thread watches the connection from now on (receiver.py, step 5)
                    self._receiver.watch(monitor, peer, generation)
                    continue
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                monitor.close(linger=0)

    def _await_control(self, sock: zmq.Socket, monitor: zmq.Socket, peer: int, deadline: float) -> dict:
        """The peer's next handshake message; fails at once if the connection is refused or drops."""
        who = f"rank {peer}"
        while not sock.poll(SLICE_S * 1000, zmq.POLLIN):
            if self._closed.is_set():
                raise PeerFailure(peer, "transport is closed")
            if remaining(deadline) <= 0:
                raise PeerFailure(peer, "no answer to the handshake before the deadline")
            if monitor.poll(0, zmq.POLLIN):
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                raise PeerFailure(peer, "connection refused" if event == zmq.EVENT_CLOSED else "connection lost")
        return parse_control(sock.recv_multipart(zmq.NOBLOCK), who)

    def _writer_for(self, out: _OutConn, peer: int):
        def write(chunk: Chunk) -> None:
            with out.lock:
                if out.closed or out.abort.is_set():
                    raise PeerFailure(peer, "connection closed")
                self._check_refused(out, peer)
                tracker = self._send_chunk(out, peer, chunk)
                self._await_sent(out, peer, tracker, chunk.deadline)
        return write

    def _send_chunk(self, out: _OutConn, peer: int, chunk: Chunk) -> zmq.MessageTracker | None:
        # Chunks are sent one at a time, so a DEALER without room has no connection left (libzmq dropped its
        # queue when the connection ended and does not reconnect).
        parts = [chunk.header, memoryview(chunk.payload.numpy())]
        lost_at = now() + LOST_AFTER_S
        while True:
            try:
                return out.sock.send_multipart(parts, zmq.NOBLOCK, copy=False, track=True)
            except zmq.Again:
                pass
            if out.abort.is_set():
                raise PeerFailure(peer, "transport is closing")
            if remaining(chunk.deadline) <= 0:
                raise PeerFailure(peer, "deadline passed while sending")
            if now() > lost_at:
                self._check_refused(out, peer)
                raise PeerFailure(peer, "connection lost (the peer closed or died)")
            out.sock.poll(SLICE_S * 1000, zmq.POLLOUT)

    @staticmethod
    def _await_sent(out: _OutConn, peer: int, tracker: zmq.MessageTracker | None, deadline: float) -> None:
        """Wait until libzmq let go of the payload (written to the kernel); small payloads were copied."""
        while tracker is not None and not tracker.done:
            if out.abort.is_set():
                raise PeerFailure(peer, "transport is closing")
            left = remaining(deadline)
            if left <= 0:
                raise PeerFailure(peer, "deadline passed while sending")
            with contextlib.suppress(zmq.NotDone):
                tracker.wait(min(SLICE_S, left))

    @staticmethod
    def _check_refused(out: _OutConn, peer: int) -> None:
        """The receiver only ever writes to a DEALER after the handshake to refuse it."""
        if out.sock.poll(0, zmq.POLLIN):
            try:
                msg = parse_control(out.sock.recv_multipart(zmq.NOBLOCK), f"rank {peer}")
            except OpenPrimeError as e:
                msg = {"reason": str(e)}
            raise PeerFailure(peer, f"peer refused the connection: {msg.get('reason')}")

    def _link_lost(self, peer: int, generation: int) -> bool:
        """Called by the receiver thread when a DEALER to `peer` disconnected; True if it was a current one."""
        link = self._out[peer]
        if link.generation != generation:
            return False
        link.lost_generation = generation  # the next send reconnects (no lock: the receiver never waits)
        return True

    def _drop(self, link: _OutLink, *, drain_deadline: float, goodbye: bool = False) -> None:
        """Stop the writers (letting queued chunks leave until `drain_deadline`), then close the DEALERs."""
        for writer in link.writers:
            writer.stop(timeout_s=remaining(drain_deadline))
        for out in link.conns:
            out.abort.set()  # a writer still waiting on a chunk gives up within one slice
        for out in link.conns:
            with out.lock:
                out.closed = True
                linger = 0
                with contextlib.suppress(zmq.ZMQError):
                    out.sock.disable_monitor()  # the receiver thread then closes the monitor (EVENT_MONITOR_STOPPED)
                if goodbye and link.usable:
                    with contextlib.suppress(zmq.ZMQError):
                        out.sock.send(encode_control(BYE), zmq.NOBLOCK)
                        linger = BYE_LINGER_MS
                out.sock.close(linger=linger)
        link.writers, link.conns, link.broken = [], [], True

    # ------------------------------------------------------------------ receiving

    def irecv_add(self, peer: int, tag: int, acc: torch.Tensor, *, scratch: torch.Tensor, deadline: float) -> Handle:
        # The receiver adds each chunk from libzmq's message into `acc` (scratch stays untouched): one copy less.
        check_add_buffers(acc, scratch)
        self._receivable(peer)
        return self._mailbox.post(peer, tag, [scratch], deadline, acc)

    def _lose_peer(self, peer: int, reason: str) -> None:
        self._receiver.lose_unless_connected(peer, reason)

    def _receivable(self, peer: int) -> None:  # irecv: MailboxReceives; irecv_add
        super()._receivable(peer)
        if self._receiver.failure is not None:
            raise PeerFailure(peer, self._receiver.failure)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        # Waiting receives fail now, not after the sends below had DRAIN_S to leave (a peer that does not read holds
        # them that long). The receiver thread may go on delivering until it stops: into no receive, once they failed.
        self._mailbox.fail_all("transport is closed")
        drain_deadline = now() + DRAIN_S
        for link in self._out.values():
            with link.lock:
                self._drop(link, drain_deadline=drain_deadline, goodbye=True)
        clean = self._receiver.stop(timeout_s=2.0)
        if clean:
            _terminate(self._ctx, timeout_s=BYE_LINGER_MS / 1000 + 1.0)
        else:
            log.warning("rank %d: the ZeroMQ receiver thread did not stop; leaving its context", self.rank)


def _terminate(ctx: zmq.Context, timeout_s: float) -> None:
    """Terminate the context (it waits for goodbyes to flush, up to their linger) without ever hanging."""
    thread = threading.Thread(target=ctx.term, name="zmq-term", daemon=True)
    thread.start()
    thread.join(timeout=timeout_s)
    if thread.is_alive():
        log.warning("the ZeroMQ context did not terminate within %.1fs", timeout_s)


def _close_quietly(sock: zmq.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.close(linger=0)


def create_zmq_transport(rendezvous: Rendezvous, rank: int, world_size: int,
                         config: StreamTransportConfig | None = None) -> ZmqTransport:
    """The TransportFactory of this package (use functools.partial to bind a config)."""
    return ZmqTransport(rendezvous, rank, world_size, config or StreamTransportConfig())
