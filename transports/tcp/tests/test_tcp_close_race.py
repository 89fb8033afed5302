"""A close from another thread (the abort of a doomed try, openprime.mesh.abort) may land between a send's
connect and its dealing of chunks to the connection's writers: the send must fail as a PeerFailure, which the
callers handle, not with another error.

tools/chaos.py (seed 21, 2 local ranks, tcp, non-blocking recovery, 2026-12-05) hit it: the send found the
writers gone and raised ZeroDivisionError (`turn % len(writers)`), and the two nodes that still held the run's
state crashed; every node after them was refused. The zmq transport already checked its link under the lock.
"""

import socket
import threading
import time

import attrs
import pytest
import torch

from openprime.core.collectives import TAG_ALL_REDUCE
from openprime.core.distributed import host_store
from openprime.core.errors import PeerFailure
from openprime.core.streams import StreamTransportConfig
from openprime.core.testing import run_threads
from openprime.core.transport import Rendezvous
from openprime.transports.tcp import TcpTransport

CONFIG = StreamTransportConfig(connect_timeout_s=5, num_connections=2)


_STORES = []  # the rendezvous stores, alive while the transports' connections look their peers up


def _pair(group: str) -> list[TcpTransport]:
    store = host_store(timeout_s=10)
    _STORES.append(store)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group=group)
    return run_threads([lambda: TcpTransport(rendezvous, 0, 2, CONFIG), lambda: TcpTransport(rendezvous, 1, 2, CONFIG)])


def test_a_send_overtaken_by_a_close_from_another_thread_raises_peer_failure():
    sender, receiver = _pair("close-race")
    connected = sender._connected

    def connected_then_closed(peer, deadline):
        link = connected(peer, deadline)
        sender.close()  # the abort's close, from the watch thread, lands here
        return link

    try:
        sender.send(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=time.monotonic() + 5)  # a healthy send first
        sender._connected = connected_then_closed
        with pytest.raises(PeerFailure, match="transport is closed"):
            sender.isend(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=time.monotonic() + 5).wait()
    finally:
        sender.close()
        receiver.close()


class _ClosingOnLookup(dict):
    """The transport's links, closing the transport when the first send looks its link up: the close lands after
    the send's check that the transport is open and before it takes the link's lock."""

    def __init__(self, links, transport):
        super().__init__(links)
        self.transport = transport

    def __getitem__(self, peer):
        self.transport.close()
        return super().__getitem__(peer)


def test_a_close_between_the_open_check_and_the_links_lock_does_not_reconnect():
    # The link was dropped by the close (broken): the send used to reconnect it, leaving a closed transport with
    # live sockets and writer threads, and a send that went through after the abort.
    sender, receiver = _pair("close-race-reconnect")
    try:
        sender._out = _ClosingOnLookup(sender._out, sender)
        with pytest.raises(PeerFailure, match="transport is closed"):
            sender.isend(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=time.monotonic() + 5).wait()
        link = dict.__getitem__(sender._out, 1)
        assert link.broken and not link.writers and not link.sockets
    finally:
        sender.close()
        receiver.close()


def test_a_link_broken_between_the_connect_and_the_dealing_fails_the_send_and_the_next_send_reconnects():
    # A writer failed (or the peer closed its end) after the send's connect: the send fails at once as a
    # PeerFailure rather than dealing its chunks to writers whose connections are gone (openprime.core.
    # stream_transport, shared with the zmq transport since 2026-12-06), and the next send opens a new generation.
    sender, receiver = _pair("broken-race")
    connected = sender._connected

    def connected_then_broken(peer, deadline):
        link = connected(peer, deadline)
        link.broken = True  # what _send_failed does when a writer of this generation fails
        return link

    try:
        got = torch.zeros(4)
        receiving = receiver.irecv(0, TAG_ALL_REDUCE, [got], deadline=time.monotonic() + 5)
        sender.send(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=time.monotonic() + 5)
        receiving.wait()
        generation = sender._out[1].generation
        sender._connected = connected_then_broken
        with pytest.raises(PeerFailure, match="connection lost"):
            sender.isend(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=time.monotonic() + 5)
        del sender._connected  # the class's again
        # A new generation: the receiver starts the sender's streams afresh (sequence numbers from 0) and may fail
        # what was posted before, when the old connections' end reaches it first; what comes after is received.
        sender.send(1, TAG_ALL_REDUCE, [torch.full((4,), 2.0)], deadline=time.monotonic() + 5)
        receiver.irecv(0, TAG_ALL_REDUCE, [got], deadline=time.monotonic() + 5).wait()
        assert torch.equal(got, torch.full((4,), 2.0))
        assert sender._out[1].generation == generation + 1
    finally:
        sender.close()
        receiver.close()


def test_every_connection_probes_its_peer_while_it_idles():
    """A mesh keeps one group per epoch: its connections idle through every inner phase (about 38 minutes in
    INTELLECT-1), longer than NATs keep an idle mapping (an AWS NAT gateway: 350 s). ZeroMQ's sockets kept them with
    keepalive probes; the TCP transport's had none (review of 2026-12-07). Both ends of every connection do now."""
    from openprime.core.streams import KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S

    sender, receiver = _pair("keepalive")
    try:
        sender.send(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=time.monotonic() + 5)
        receiver.recv(0, TAG_ALL_REDUCE, [torch.empty(4)], deadline=time.monotonic() + 5)
        socks = [*sender._out[1].sockets, *receiver._in_sockets[0]]
        assert len(socks) == 2 * CONFIG.num_connections
        for sock in socks:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert (sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)) == (
                KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT)
    finally:
        sender.close()
        receiver.close()


def _threads_of_rank(rank: int, among: set[threading.Thread]) -> list[str]:
    """Names of the live threads of rank `rank`'s transport (tcp-KIND-RANK[-PEER...]) not in `among`."""
    return sorted(t.name for t in threading.enumerate()
                  if t not in among and t.name.startswith("tcp-") and t.name.split("-")[2] == str(rank))


def _await_no_threads_of_rank(rank: int, among: set[threading.Thread], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (alive := _threads_of_rank(rank, among)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def test_a_connection_registered_after_a_close_is_closed_and_not_served():
    # A peer's connection accepted and authenticated just before a close, and registered just after it: it joined the
    # incoming connections the close had already closed, and its reader thread served it on, after close() returned,
    # as long as the peer kept it open (review of 2026-12-07). One connection: with more, the peer's next one is
    # refused (the listener is closed) and the peer itself closes the first.
    store = host_store(timeout_s=10)
    _STORES.append(store)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="close-race-register")
    config = attrs.evolve(CONFIG, num_connections=1)
    before = set(threading.enumerate())
    receiver = TcpTransport(rendezvous, 0, 2, config)  # patched before its peer exists, so before it connects
    register, registered = receiver._register, threading.Event()

    def closed_then_registered(peer, sock, generation):
        closer = threading.Thread(target=receiver.close, name="closer")
        closer.start()
        closer.join(timeout=10)
        try:
            register(peer, sock, generation)
        finally:
            registered.set()

    receiver._register = closed_then_registered
    sender = TcpTransport(rendezvous, 1, 2, config)
    try:
        assert registered.wait(timeout=10)
        # Bounded at two connect timeouts: a thread of the transport blocked on a socket gives up within one. Before
        # the fix the reader served on for as long as the peer kept the connection open: here, past any bound.
        assert _await_no_threads_of_rank(0, before, timeout_s=2 * CONFIG.connect_timeout_s) == []
        socks = [s for socks in receiver._in_sockets.values() for s in socks]
        assert all(s.fileno() == -1 for s in socks), socks
        # Refused, not registered: a registration after close() also reset the peer's streams in the closed mailbox.
        assert socks == [] and receiver._in_generation == {}, (socks, receiver._in_generation)
    finally:
        sender.close()
        receiver.close()


def test_a_close_ends_the_handshake_of_a_client_that_never_finishes_it():
    # A client that connected and froze (or a port scanner) before it said hello: its reader thread waited for the
    # hello until the connect timeout, past close() (review of 2026-12-07).
    store = host_store(timeout_s=10)
    _STORES.append(store)
    before = set(threading.enumerate())
    transport = TcpTransport(Rendezvous(host="127.0.0.1", port=store.port, group="close-handshake"), 0, 2, CONFIG)
    client = socket.create_connection(transport._listener.getsockname()[:2], timeout=10)
    try:
        assert _await_threads_named("tcp-recv-0", before, timeout_s=10)
        start = time.monotonic()
        transport.close()
        assert _await_no_threads_of_rank(0, before, timeout_s=1.0) == []
        assert time.monotonic() - start < 1.0 < CONFIG.connect_timeout_s
    finally:
        client.close()
        transport.close()


def _await_threads_named(name: str, among: set[threading.Thread], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not any(t.name == name and t not in among for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
