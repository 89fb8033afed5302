"""Review of the TCP transport: close() and connections that do not answer."""

import socket
import threading
import time

from openprime.core.distributed import connect_store, host_store
from openprime.core.streams import StreamTransportConfig
from openprime.core.transport import Rendezvous
from openprime.transports.tcp import TcpTransport

CONNECT_TIMEOUT_S = 5.0
CONFIG = StreamTransportConfig(connect_timeout_s=CONNECT_TIMEOUT_S, num_connections=1)


def _silent_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose accept queue is full: the kernel drops every further SYN, as a peer's machine that
    vanished (powered off, cut off by a partition) leaves a connect without an answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=2)  # takes the one place in the queue
    return listener, [filler]


def _threads_of_rank(rank: int, among: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t not in among and t.name.startswith("tcp-") and t.name.split("-")[2] == str(rank))


def test_close_does_not_wait_for_a_connect_that_gets_no_answer():
    """The background connect to a peer whose SYNs go unanswered held the link's lock for the whole connect timeout
    (60 s by default), and close() (a doomed try's abort) waited for it: close() must not hang."""
    store = host_store(timeout_s=10)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="silent-peer")
    listener, fillers = _silent_listener()
    connect_store(rendezvous, 5, suffix="/tcp").set("addr/1", f"127.0.0.1:{listener.getsockname()[1]}")
    before = set(threading.enumerate())
    transport = TcpTransport(rendezvous, 0, 2, CONFIG)
    try:
        time.sleep(0.5)  # the background connect to rank 1 is waiting for an answer to its SYN
        start = time.monotonic()
        transport.close()
        took = time.monotonic() - start
        assert took < 1.0 < CONNECT_TIMEOUT_S, took
        deadline = time.monotonic() + 2.0
        while _threads_of_rank(0, before) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _threads_of_rank(0, before) == []
    finally:
        transport.close()
        for sock in [*fillers, listener]:
            sock.close()


def test_a_transport_whose_store_fails_leaves_no_listening_socket(monkeypatch):
    # The listener was opened, then the store's set failed (its host died): the socket stayed open, one per try.
    from openprime.core import stream_transport

    store = host_store(timeout_s=10)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="store-fails")
    made: list[socket.socket] = []
    create_server = socket.create_server

    def tracked(*args, **kwargs):
        made.append(create_server(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(socket, "create_server", tracked)
    real_connect = stream_transport.connect_store

    class _Dying:
        def __init__(self, inner):
            self._inner = inner

        def set(self, key, value):
            raise RuntimeError("store gone")

        def __getattr__(self, name):
            return getattr(self._inner, name)

    monkeypatch.setattr(stream_transport, "connect_store", lambda *a, **k: _Dying(real_connect(*a, **k)))
    try:
        TcpTransport(rendezvous, 0, 2, CONFIG)
    except RuntimeError as e:
        assert "store gone" in str(e)
    else:
        raise AssertionError("the transport was built although its store failed")
    assert len(made) == 1 and made[0].fileno() == -1  # closed
