"""A Transport over plain TCP sockets, for networks where Gloo and VPNs get in the way.

INTELLECT-1's Tailscale VPN became its bottleneck (paper, section 3.1); this transport needs only one
open TCP port per node. Each rank listens on one socket and publishes its address in the rendezvous
store. To send to a peer it opens `num_connections` connections to it (lazily, on first use), proves
itself in a handshake (run id, and an HMAC challenge-response when the site has a shared secret), and
from then on only writes data frames on them; the peer only reads. Each direction of each pair thus
has its own connections, and a reader thread per incoming connection fills the receiver's buffers
directly (openprime.core.mailbox). Large messages are striped over the connections (outbox.py).

A peer that restarts comes back with a new incarnation: its connections replace the old ones and
sequence numbers restart. A connection that breaks makes the sender reconnect with a new generation on
its next send. Frames that are not valid (magic, version, size, msgpack, tag) close that connection,
are logged with the peer's address, and never stop the transport from serving its other peers.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import defaultdict
from collections.abc import Iterator

from openprime.core import auth
from openprime.core.distributed import peer_address
from openprime.core.errors import ConfigError, FrameError, OpenPrimeError, PeerFailure
from openprime.core.frames import (
    KIND_CONTROL,
    PREFIX_BYTES,
    decode_control,
    decode_header,
    decode_prefix,
    encode_control,
)
from openprime.core.outbox import Chunk, ConnectionWriter, now
from openprime.core.shaping import LinkShaper
from openprime.core.stream_transport import OutLink, StreamTransport
from openprime.core.streams import StreamTransportConfig, keep_alive
from openprime.core.transport import Rendezvous, remaining

TcpTransportConfig = StreamTransportConfig
_DISCARD_BYTES = 1 << 20
_BYE = {"op": "bye"}


def _recv_exact_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean end of stream before the first byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes of a frame")
        got += n
    return True


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_exact_into(sock, memoryview(buf)) else None


def _read_control(sock: socket.socket, who: str) -> dict:
    prefix = _recv_exact(sock, PREFIX_BYTES)
    if prefix is None:
        raise ConnectionError("connection closed during the handshake")
    kind, n = decode_prefix(prefix, who)
    if kind != KIND_CONTROL:
        raise FrameError(who, "expected a handshake frame")
    return decode_control(_recv_exact(sock, n) or b"", who)


class _OutLink(OutLink):
    """OutLink with the link's sockets, one per connection."""

    def __init__(self, shaper: LinkShaper) -> None:
        super().__init__(shaper)
        self.sockets: list[socket.socket] = []


class TcpTransport(StreamTransport):
    """Transport over TCP with parallel connections per peer; see the module docstring."""

    # irecv_add is Transport's: the message lands in the scratch buffer straight from the socket and is added once
    # it is whole. Adding each chunk in the connections' threads (as ZeroMQ does, which saves it a copy) measured ~4%
    # slower here at n=2.

    def __init__(self, rendezvous: Rendezvous, rank: int, world_size: int, config: StreamTransportConfig) -> None:
        super().__init__(rendezvous, rank, world_size, config, kind="tcp", new_link=_OutLink)
        self._lock = threading.Lock()
        self._in_generation: dict[int, tuple[str, int]] = {}
        self._in_sockets: dict[int, list[socket.socket]] = defaultdict(list)
        self._handshaking: set[socket.socket] = set()  # connections in their handshake, either way: close() ends them
        try:
            self._listener = socket.create_server((config.bind_host, 0), backlog=128)
        except OSError as e:
            raise ConfigError(config.cannot_listen(e.strerror or e)) from None
        port = self._listener.getsockname()[1]
        try:
            self._store.set(f"addr/{rank}", f"{config.hostname}:{port}")  # where peers reach it (listen_host: bound)
        except BaseException:  # the store died: no transport, and no listening socket left open for each try
            self._listener.close()
            raise
        threading.Thread(target=self._accept_loop, name=f"tcp-accept-{rank}", daemon=True).start()
        self._connect_early()

    # ------------------------------------------------------------------ sending (isend: StreamTransport)

    def _connect(self, peer: int, link: _OutLink, deadline: float) -> None:
        """(Re)open all connections to `peer` as a new generation. Holds link.lock."""
        self._drop(link)
        link.generation += 1
        link.next_seq.clear()
        timeout = min(self.config.connect_timeout_s, max(remaining(deadline), 0.001))
        addressed = False  # the peer published its address: a failure from here on is the link's (unreachable)
        try:
            host, port = peer_address(self._store, peer, deadline=now() + timeout, closed=self._closed).rsplit(":", 1)
            addressed = True
            for conn in range(self.config.num_connections):
                sock = self._dial(host, int(port), timeout)
                link.sockets.append(sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keep_alive(sock)  # these connections idle through every inner phase: NATs drop idle mappings
                self._client_handshake(sock, peer, conn, link.generation)
        except (OSError, OpenPrimeError, RuntimeError) as e:
            self._drop(link)
            if isinstance(e, auth.Refused):
                self._refuse(f"rank {peer}", str(e))
            if addressed and not self._closed.is_set():
                self._reached(peer, False)
            raise PeerFailure(peer, f"cannot connect: {e}") from None
        self._reached(peer, True)
        threading.Thread(target=self._watch, args=(peer, link.generation, link.sockets[0]), daemon=True,
                         name=f"tcp-watch-{self.rank}-{peer}").start()
        for conn, sock in enumerate(link.sockets):
            link.writers.append(ConnectionWriter(
                f"tcp-send-{self.rank}-{peer}-{conn}", self._writer_for(sock), link.shaper,
                on_error=lambda e, p=peer, g=link.generation: self._send_failed(p, g, e)))
        link.broken = False

    def _dial(self, host: str, port: int, timeout: float) -> socket.socket:
        """socket.create_connection, with the socket tracked while it connects so that close() can end the connect: a
        peer whose machine vanished (powered off, cut off) never answers the SYN, and the connect held the link's lock,
        which close() takes, for the whole connect timeout."""
        error: OSError = OSError(f"cannot resolve {host}")
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(timeout)
                with self._in_handshake(sock):
                    sock.connect(address)
                return sock
            except OSError as e:
                sock.close()
                error = e
        raise error

    def _client_handshake(self, sock: socket.socket, peer: int, conn: int, generation: int) -> None:
        with self._in_handshake(sock):
            nonce = auth.new_nonce()
            sock.sendall(encode_control(auth.hello(self.config.auth, rank=self.rank, to=peer, conn=conn,
                                                   incarnation=self._incarnation, generation=generation, nonce=nonce)))
            reply = _read_control(sock, f"rank {peer}")
            proof = auth.client_answer(reply, auth=self.config.auth, secret=self._secret, rank=self.rank, nonce=nonce)
            if proof is not None:
                sock.sendall(encode_control(proof))
                auth.client_answer(_read_control(sock, f"rank {peer}"), auth=self.config.auth, secret=None,
                                   rank=self.rank, nonce=nonce)

    @contextlib.contextmanager
    def _in_handshake(self, sock: socket.socket) -> Iterator[None]:
        """Track `sock` while its handshake runs, so that close() can end it: a peer that froze after it accepted our
        connection (or after it connected to us) never answers, and the handshake's read waited for it until the
        connect timeout, past close(): on our connection holding the link's lock, which close() takes; on theirs, a
        reader thread and its socket."""
        with self._lock:
            if self._closed.is_set():
                raise ConnectionError("transport is closed")
            self._handshaking.add(sock)
        try:
            yield
        finally:
            with self._lock:
                self._handshaking.discard(sock)

    @staticmethod
    def _writer_for(sock: socket.socket):
        def write(chunk: Chunk) -> None:
            sock.settimeout(max(remaining(chunk.deadline), 0.001))
            sock.sendall(chunk.header)
            if chunk.payload.numel():
                sock.sendall(memoryview(chunk.payload.numpy()))
        return write

    def _watch(self, peer: int, generation: int, sock: socket.socket) -> None:
        """The peer never writes on our connections: anything that ends a read means it closed or died."""
        while True:
            try:
                if not sock.recv(1):
                    break
            except TimeoutError:  # the writer's deadline timeout applies to this socket too
                continue
            except OSError:
                break
        self._send_failed(peer, generation, ConnectionError("peer closed the connection"))

    def _drop(self, link: _OutLink, *, goodbye: bool = False) -> None:
        stopped = [writer.stop(timeout_s=0.5) for writer in link.writers]
        for sock, writer_done in zip(link.sockets, stopped + [True] * (len(link.sockets) - len(stopped)), strict=True):
            # A writer still inside sendall owns its socket: a goodbye now would interleave with its frame.
            if goodbye and not link.broken and writer_done:
                _send_quietly(sock, encode_control(_BYE))
            _close(sock)
        link.writers, link.sockets, link.broken = [], [], True

    # ------------------------------------------------------------------ receiving

    def _lose_peer(self, peer: int, reason: str) -> None:
        with self._lock:
            # A peer connected to this rank sends over those connections: its death or goodbye is seen there, after
            # what it sent before (which a refused connect to a peer that sent, then closed, would have failed).
            if self._in_sockets.get(peer):
                return
            # Under the lock, as _register's peer_back is: marked lost after the check released it, a peer whose first
            # connection registered in between stayed lost, every receive from it failing (found 2026-12-08 by review).
            self._mailbox.peer_lost(peer, reason)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # the listener was closed
            thread = threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True,
                                      name=f"tcp-recv-{self.rank}")
            thread.start()

    def _serve(self, sock: socket.socket, addr: str) -> None:
        peer = None
        try:
            keep_alive(sock)
            sock.settimeout(self.config.connect_timeout_s)
            peer = self._server_handshake(sock, addr)
            sock.settimeout(None)
            self._read_frames(sock, peer, addr)
        except auth.Refused as e:
            self._refuse(addr, str(e))
            _send_quietly(sock, encode_control({"op": "refused", "reason": str(e)}))
        except FrameError as e:
            self._refuse(addr, str(e))
            if peer is not None:
                self._mailbox.peer_lost(peer, f"sent an invalid frame: {e.reason}")
        except OSError as e:
            if peer is None and not self._closed.is_set():
                self._refuse(addr, f"connection closed during the handshake ({e}); a wrong secret or run id?")
            elif peer is not None and not self._closed.is_set() and self._is_current(peer, sock):
                self._mailbox.peer_lost(peer, f"connection lost: {e}")
        finally:
            _close(sock)

    def _server_handshake(self, sock: socket.socket, addr: str) -> int:
        with self._in_handshake(sock):
            msg = _read_control(sock, addr)
            reply, server_nonce = auth.server_reply(msg, auth=self.config.auth, secret=self._secret,
                                                    my_rank=self.rank, world_size=self.world_size)
            peer = msg["rank"]
            if server_nonce is not None:
                sock.sendall(encode_control(reply))
                auth.server_check(_read_control(sock, addr), auth=self.config.auth, secret=self._secret,
                                  client_rank=peer, server_nonce=server_nonce)
                reply = {"op": "ok"}
            self._register(peer, sock, (msg["incarnation"], msg["generation"]))
            sock.sendall(encode_control(reply))
        return peer

    def _register(self, peer: int, sock: socket.socket, generation: tuple[str, int]) -> None:
        with self._lock:
            if self._closed.is_set():
                # Accepted before close() and registered after it: close() already closed the connections it knew of,
                # and this one's reader would serve it on after close() returned.
                raise ConnectionError("transport is closed")
            previous = self._in_generation.get(peer)
            if previous != generation:
                self._in_generation[peer] = generation
                for old in self._in_sockets.pop(peer, []):
                    _close(old)
                if previous is not None:
                    # A restarted peer, or one that reconnected after a failure: its streams start afresh.
                    self._mailbox.peer_reset(peer)
                else:
                    self._mailbox.peer_back(peer)  # it may have been marked lost when we could not reach it
            self._in_sockets[peer].append(sock)

    def _is_current(self, peer: int, sock: socket.socket) -> bool:
        with self._lock:
            return sock in self._in_sockets.get(peer, [])

    def _read_frames(self, sock: socket.socket, peer: int, addr: str) -> None:
        who = f"rank {peer} at {addr}"
        prefix = bytearray(PREFIX_BYTES)
        while _recv_exact_into(sock, memoryview(prefix)):
            kind, n = decode_prefix(prefix, who)
            if kind == KIND_CONTROL:
                if decode_control(_recv_exact(sock, n) or b"", who) != _BYE:
                    raise FrameError(who, "handshake frame after the handshake")
                self._goodbye(peer, sock)
                return
            header = decode_header(_recv_exact(sock, n) or b"", who, max_frame_bytes=self.config.max_frame_bytes)
            framed = PREFIX_BYTES + n + header.length
            token, region = self._mailbox.target(peer, header, framed)
            if region is None:
                _discard(sock, header.length)
            elif region.numel() and not _recv_exact_into(sock, memoryview(region.numpy())):
                raise ConnectionError("connection closed inside a frame")
            self._mailbox.delivered(peer, header, token, framed)
        # The stream ended without a goodbye: the peer process died (kill -9 looks like this).
        if not self._closed.is_set() and self._is_current(peer, sock):
            self._mailbox.peer_lost(peer, "connection ended without a goodbye: the peer died")

    def _goodbye(self, peer: int, sock: socket.socket) -> None:
        """A graceful close: once every connection from `peer` said goodbye, nothing more will come."""
        with self._lock:
            socks = self._in_sockets.get(peer, [])
            if sock in socks:
                socks.remove(sock)
            closed = not socks
        if closed:
            self._mailbox.peer_lost(peer, "peer closed its transport")

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        # Waiting receives fail now, not after the writers below had their time to drain (0.5 s each, stuck on a
        # peer that does not read).
        self._mailbox.fail_all("transport is closed")
        _close(self._listener)
        with self._lock:
            for sock in self._handshaking:  # wakes its reader, which closes it (and releases the link it connects)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for link in self._out.values():
            with link.lock:
                self._drop(link, goodbye=True)
        with self._lock:
            for socks in self._in_sockets.values():
                for sock in socks:
                    _close(sock)


def _discard(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _DISCARD_BYTES)))
    while n > 0:
        if not _recv_exact_into(sock, scratch[: min(n, len(scratch))]):
            raise ConnectionError("connection closed inside a frame")
        n -= min(n, len(scratch))


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def create_tcp_transport(rendezvous: Rendezvous, rank: int, world_size: int,
                         config: StreamTransportConfig | None = None) -> TcpTransport:
    """The TransportFactory of this package (use functools.partial to bind a config)."""
    return TcpTransport(rendezvous, rank, world_size, config or StreamTransportConfig())
