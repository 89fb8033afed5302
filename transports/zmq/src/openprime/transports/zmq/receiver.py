"""The receive side of the ZeroMQ transport: one ROUTER socket, one thread, every peer's connections.

Each rank binds one ROUTER socket (one open TCP port per node: INTELLECT-1's VPN was its bottleneck,
paper section 3.1). Every connection a peer opens to it is a DEALER with its own routing id. The
receiver thread owns the ROUTER and, per routing id:

  1. runs the handshake of openprime.core.auth (hello -> ok, or hello -> challenge -> auth -> ok),
     answering through the ROUTER; data from an id that has not completed it is refused;
  2. validates every frame (magic, version, sizes, msgpack, tag, part count, payload length) before
     it touches the mailbox; a bad frame refuses that id (logged with the peer's address, appended to
     `refusals`) and the transport goes on serving everyone else;
  3. copies each payload once, from ZeroMQ's message into the receiver's posted buffer (or into the
     mailbox's bounded unexpected store), or, for a receive that adds (Transport.irecv_add), adds it
     from ZeroMQ's message into the accumulator;
  4. notices when the connection behind an id ends. A peer that closes says "bye" on each connection
     first; a connection that ends without one means the peer died, and its pending receives fail at
     once (mailbox.peer_lost) rather than at their deadline;
  5. watches this rank's own DEALERs to each peer (their socket monitors, handed over by the
     transport): a peer that dies before its own connections to us were ready is still seen at once.

Step 4 is the subtle one. libzmq's in-band disconnect notice (ZMQ_ROUTER_NOTIFY) is a draft API that
pyzmq's wheels do not ship, so the end of a connection is learnt from the socket monitor, which names
the connection by file descriptor (EVENT_ACCEPTED / EVENT_DISCONNECTED), and a message names the file
descriptor it came from (ZMQ_SRCFD). Descriptors are reused, so each accepted descriptor is counted as
an epoch and a routing id is bound to (fd, epoch) when its first message is read (the accept event is
always emitted before the connection's first message). A disconnect event arrives while messages the
connection sent before it ended may still be queued in its pipe (a "bye" among them), so the id is
only finalised once the ROUTER has been seen empty after the event, or the id stayed silent for
`ENDING_GRACE_S` while the thread kept reading (ZeroMQ queues fairly between connections).

Step 5 fails a peer only when it has no ready connection to us: when it has, those connections carry
the news in order with its data (a peer that closes after its last send must not fail that receive).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from openprime.core import auth
from openprime.core.errors import ConfigError, FrameError
from openprime.core.frames import KIND_CONTROL, decode_control, decode_header, encode_control
from openprime.core.mailbox import Mailbox
from openprime.core.streams import StreamTransportConfig
from openprime.transports.zmq.wire import BYE, CONTROL_MAX_BYTES, configure, endpoint, parse_control, split_frame

log = logging.getLogger("openprime.transports.zmq")
POLL_S = 0.05  # how often the thread looks at its stop flag and at connections that ended
ENDING_GRACE_S = 0.5
BATCH = 256  # messages read between two looks at the monitor and the stop flag
QUEUE_BYTES_PER_CONNECTION = 16 << 20  # what libzmq may hold per connection before TCP pushes back
MAX_PARTS = 2  # a data frame is header + payload; more parts are drained and refused


class _Conn:
    """What the receiver knows about one routing id (one DEALER connection of a peer)."""

    def __init__(self, ident: bytes, ip: str, fd: int, epoch: int) -> None:
        self.ident, self.fd, self.epoch = ident, fd, epoch
        self.addr = f"{ip} (connection {_label(ident)})"  # libzmq tells the IP of a message's sender, not its port
        self._unauthenticated = f"{ip} (connection {_label(ident)}, unauthenticated)"
        self.state = "new"  # new -> (auth ->) ready -> closed | retired; or refused
        self.peer: int | None = None
        self.generation: tuple[str, int] | None = None
        self.nonce: bytes | None = None
        self.last_seen = time.monotonic()
        self.ended_mark: int | None = None  # the ROUTER's idle count when the connection was seen to end
        self.ended_at = 0.0

    @property
    def who(self) -> str:
        return f"rank {self.peer} at {self.addr}" if self.state == "ready" else self._unauthenticated


def _label(ident: bytes) -> str:
    text = ident.decode("ascii", errors="replace")
    return text if ident.isascii() and text.isprintable() else ident.hex()


def _message_property(frame: zmq.Frame, name: int | str, default: int | str) -> int | str:
    try:
        return frame.get(name)
    except zmq.ZMQError:
        return default


class Receiver:
    """Owns the ROUTER socket and the thread that serves it; see the module docstring."""

    def __init__(self, ctx: zmq.Context, config: StreamTransportConfig, *, rank: int, world_size: int,
                 mailbox: Mailbox, secret: bytes | None, refuse: Callable[[str, str], None],
                 link_lost: Callable[[int, int], bool]) -> None:
        self._config, self._rank, self._world_size = config, rank, world_size
        self._mailbox, self._secret, self._refuse_cb, self._link_lost = mailbox, secret, refuse, link_lost
        self._router = ctx.socket(zmq.ROUTER)
        configure(self._router, config.bind_host)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished id fails instead of vanishing
        # libzmq drops a connection that announces a message part above this, before allocating it.
        self._router.setsockopt(zmq.MAXMSGSIZE, max(config.max_frame_bytes, CONTROL_MAX_BYTES))
        self._router.setsockopt(zmq.RCVHWM, max(2, min(64, QUEUE_BYTES_PER_CONNECTION // config.effective_chunk_bytes)))
        # The monitor must exist before the first accept, so it is set up before the port is published.
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._conns: dict[bytes, _Conn] = {}
        self._fd_epoch: dict[int, int] = defaultdict(int)
        self._fd_open: dict[int, bool] = {}
        self._by_epoch: dict[tuple[int, int], set[bytes]] = defaultdict(set)
        self._ending: set[bytes] = set()
        self._idle_count = 0
        self._generation: dict[int, tuple[str, int]] = {}
        self._ready: dict[int, set[bytes]] = defaultdict(set)
        self._lost: set[int] = set()  # peers this side declared lost (mailbox.peer_lost) since they last connected
        # Held to register a connection and to declare a peer lost: a connect thread's lose_unless_connected found no
        # connection, the receiver thread then registered the peer's first one, and the peer was marked lost while
        # connected, every receive from it failing until it reconnected (found 2026-12-08 by review).
        self._registry = threading.Lock()
        self._handover: queue.SimpleQueue[tuple[zmq.Socket, int, int]] = queue.SimpleQueue()
        self._watched: dict[zmq.Socket, tuple[int, int]] = {}  # monitor of one of our DEALERs -> (peer, generation)
        self._stop = threading.Event()
        self.failure: str | None = None  # set if the thread itself crashed (a bug): receives then fail at once
        self._thread = threading.Thread(target=self._run, name=f"zmq-recv-{rank}", daemon=True)
        try:
            self.port = self._router.bind_to_random_port(endpoint(config.bind_host))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(config.cannot_listen(e)) from None

    def start(self) -> None:
        self._thread.start()

    def watch(self, monitor: zmq.Socket, peer: int, generation: int) -> None:
        """Take over the monitor of a DEALER to `peer` (any thread; the receiver thread owns it from now on)."""
        self._handover.put((monitor, peer, generation))

    def lose(self, peer: int, reason: str) -> None:
        """Fail what waits on `peer` until it connects again."""
        with self._registry:
            self._lose(peer, reason)

    def _lose(self, peer: int, reason: str) -> None:
        self._lost.add(peer)
        self._mailbox.peer_lost(peer, reason)

    def lose_unless_connected(self, peer: int, reason: str) -> None:
        """`lose`, unless `peer` has a connection to this rank (a connect to it failed, or a DEALER to it ended): it
        sends over that, and its death or goodbye is seen there, after what it sent before. Also called from the
        transport's connect threads: the check and the loss are one step against the receiver thread's registering."""
        with self._registry:
            if not self._ready.get(peer):
                self._lose(peer, reason)

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread (it closes its sockets); False if it did not finish within `timeout_s`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        else:  # never started: the sockets are still ours to close
            self._close_sockets()
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._take_over_monitors(poller)
                ready = dict(poller.poll(POLL_S * 1000))
                if self._monitor in ready:
                    self._drain_monitor()
                for monitor in [m for m in ready if m in self._watched]:
                    self._drain_watched(monitor, poller)
                self._drain_router()
                self._finish_ended()
        except zmq.ContextTerminated:
            pass
        except BaseException as e:  # a bug: fail what waits rather than let it wait for its deadline
            log.exception("rank %d: the ZeroMQ receiver thread crashed", self._rank)
            self.failure = f"the transport's receiver thread crashed: {e!r}"
            self._mailbox.fail_all(self.failure)
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._take_over_monitors(None)
        for monitor in self._watched:
            monitor.close(linger=0)
        self._watched.clear()
        with contextlib.suppress(zmq.ZMQError):
            self._router.disable_monitor()
        self._monitor.close(linger=0)
        self._router.close(linger=0)

    def _drain_router(self) -> None:
        for _ in range(BATCH):
            if not self._recv_one():
                self._idle_count += 1  # every pipe was empty: whatever a dead connection left has been read
                return

    def _recv_one(self) -> bool:
        try:
            first = self._router.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        parts, count, more = [], 0, first.more
        while more:  # a multipart message is delivered whole, so this never waits
            part = self._router.recv(copy=False)
            count += 1
            if count <= MAX_PARTS:
                parts.append(part)
            more = part.more
        ident = first.bytes
        conn = self._conns.get(ident) or self._new_conn(ident, first)
        conn.last_seen = time.monotonic()
        self._handle(conn, parts, count)
        return True

    # ------------------------------------------------------------------ connections coming and going

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._fd_epoch[fd] += 1
                self._fd_open[fd] = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._fd_open[fd] = False
                for ident in self._by_epoch.pop((fd, self._fd_epoch[fd]), ()):
                    self._mark_ended(self._conns[ident])

    def _take_over_monitors(self, poller: zmq.Poller | None) -> None:
        while True:
            try:
                monitor, peer, generation = self._handover.get_nowait()
            except queue.Empty:
                return
            self._watched[monitor] = (peer, generation)
            if poller is not None:
                poller.register(monitor, zmq.POLLIN)

    def _drain_watched(self, monitor: zmq.Socket, poller: zmq.Poller) -> None:
        peer, generation = self._watched[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_MONITOR_STOPPED:  # the transport closed that DEALER
                poller.unregister(monitor)
                del self._watched[monitor]
                monitor.close(linger=0)
                return
            if self._link_lost(peer, generation):
                self.lose_unless_connected(peer, "the connection to the peer ended: it closed or died")

    def _new_conn(self, ident: bytes, frame: zmq.Frame) -> _Conn:
        # Catch up with the monitor first: this connection's accept event has been emitted by now.
        self._drain_monitor()
        fd, ip = _message_property(frame, zmq.SRCFD, -1), _message_property(frame, "Peer-Address", "?")
        conn = _Conn(ident, ip, fd, self._fd_epoch[fd])
        self._conns[ident] = conn
        if fd < 0:  # a libzmq without ZMQ_SRCFD: such a connection's end is seen only through our DEALERs
            log.warning("rank %d: libzmq does not say which connection %s came from", self._rank, conn.addr)
            return conn
        self._by_epoch[(fd, conn.epoch)].add(ident)
        if not self._fd_open.get(fd, False):
            self._mark_ended(conn)  # it ended before its first message was read
        return conn

    def _mark_ended(self, conn: _Conn) -> None:
        conn.ended_mark, conn.ended_at = self._idle_count, time.monotonic()
        self._ending.add(conn.ident)

    def _finish_ended(self) -> None:
        now = time.monotonic()
        for ident in list(self._ending):
            conn = self._conns[ident]
            drained = self._idle_count > conn.ended_mark
            if not drained and now - max(conn.ended_at, conn.last_seen) < ENDING_GRACE_S:
                continue
            self._ending.discard(ident)
            del self._conns[ident]
            self._by_epoch.get((conn.fd, conn.epoch), set()).discard(ident)
            if conn.state == "ready":  # a current connection that never said goodbye
                self._ready[conn.peer].discard(ident)
                self.lose(conn.peer, "connection ended without a goodbye: the peer died")
            elif conn.state == "auth":  # the client gave up: it found our proof wrong, or it died
                self._refuse_cb(conn.addr, "connection closed during the handshake; a wrong secret or run id?")

    # ------------------------------------------------------------------ messages

    def _handle(self, conn: _Conn, parts: list[zmq.Frame], count: int) -> None:
        if conn.state in ("refused", "retired", "closed"):
            return  # refused once (logged then); or a stale generation's leftovers
        try:
            if count > MAX_PARTS:
                raise FrameError(conn.who, f"message of {count} parts (a frame has at most {MAX_PARTS})")
            if conn.state == "ready":
                self._on_frame(conn, parts)
            else:
                self._on_handshake(conn, [p.buffer for p in parts])
        except auth.Refused as e:
            self._refuse(conn, str(e))
        except FrameError as e:
            was_ready = conn.state == "ready"
            self._refuse(conn, str(e))
            if was_ready:
                self.lose(conn.peer, f"sent an invalid frame: {e.reason}")

    def _on_handshake(self, conn: _Conn, parts: list[memoryview]) -> None:
        msg = parse_control(parts, conn.who)
        if conn.state == "new":
            reply, nonce = auth.server_reply(msg, auth=self._config.auth, secret=self._secret,
                                             my_rank=self._rank, world_size=self._world_size)
            conn.peer, conn.generation = msg["rank"], (msg["incarnation"], msg["generation"])
            if nonce is not None:
                conn.state, conn.nonce = "auth", nonce
                self._reply(conn, reply)
                return
        else:
            auth.server_check(msg, auth=self._config.auth, secret=self._secret, client_rank=conn.peer,
                              server_nonce=conn.nonce)
        self._register(conn)
        self._reply(conn, {"op": "ok"})

    def _register(self, conn: _Conn) -> None:
        with self._registry:
            self._register_locked(conn)

    def _register_locked(self, conn: _Conn) -> None:
        peer = conn.peer
        previous = self._generation.get(peer)
        if previous != conn.generation:
            self._generation[peer] = conn.generation
            for ident in self._ready.pop(peer, set()):
                self._conns[ident].state = "retired"
            if previous is not None or peer in self._lost:
                # A restarted peer, or one that reconnected after a failure: its streams start afresh.
                self._lost.discard(peer)
                self._mailbox.peer_reset(peer)
        conn.state = "ready"
        self._ready[peer].add(conn.ident)

    def _on_frame(self, conn: _Conn, parts: list[zmq.Frame]) -> None:
        kind, body = split_frame(parts[0].buffer, conn.who)
        if kind == KIND_CONTROL:
            if len(parts) != 1 or decode_control(body, conn.who) != BYE:
                raise FrameError(conn.who, "handshake frame after the handshake")
            self._goodbye(conn)
            return
        header = decode_header(body, conn.who, max_frame_bytes=self._config.max_frame_bytes)
        if len(parts) != 2:
            raise FrameError(conn.who, "data frame without its payload part")
        payload = parts[1]
        if len(payload) != header.length:
            raise FrameError(conn.who, f"payload of {len(payload)} bytes, the header says {header.length}")
        framed = len(parts[0]) + header.length
        token, region = self._mailbox.target(conn.peer, header, framed)
        data = np.frombuffer(payload.buffer, dtype=np.uint8)
        if self._mailbox.adds(token):  # added from ZeroMQ's memory into the accumulator: no copy into the buffer
            self._mailbox.delivered(conn.peer, header, token, framed, payload=data)
            return
        if region is not None and header.length:
            np.copyto(region.numpy(), data)  # the one copy
        self._mailbox.delivered(conn.peer, header, token, framed)

    def _goodbye(self, conn: _Conn) -> None:
        """A graceful close: once every connection from the peer said goodbye, nothing more will come."""
        conn.state = "closed"
        ready = self._ready[conn.peer]
        ready.discard(conn.ident)
        if not ready:
            self.lose(conn.peer, "peer closed its transport")

    def _refuse(self, conn: _Conn, reason: str) -> None:
        if conn.state == "ready":
            self._ready[conn.peer].discard(conn.ident)
        conn.state = "refused"
        self._reply(conn, {"op": "refused", "reason": reason})
        self._refuse_cb(conn.addr, reason)

    def _reply(self, conn: _Conn, msg: dict) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the DEALER is gone or not reading: nothing to tell
            self._router.send_multipart([conn.ident, encode_control(msg)], zmq.NOBLOCK)
