"""A rendezvous store whose process does not run (SIGSTOP: its machine paused, or cut off without a connection reset)
answers no request, and torch's TCPStore client then waits past its own timeout in `check` and `get`. A peer's
address lookup held the link's lock through that wait: the try's sends blocked past their deadline, and so did the
abort that closes the try's transport (found 2026-12-07 by a review of the node side of membership)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from openprime.core.distributed import peer_address, store_client
from openprime.core.errors import PeerFailure
from openprime.core.harness import await_stopped
from openprime.core.transport import Rendezvous

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP") or not os.path.exists("/proc/self/stat"),
                                reason="needs SIGSTOP and /proc")


@pytest.fixture
def store():
    """(port, freeze) of a rendezvous store in another process; freeze() stops it (SIGSTOP)."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import datetime, time, torch.distributed as dist\n"
         "s = dist.TCPStore('127.0.0.1', 0, is_master=True, timeout=datetime.timedelta(seconds=30), "
         "wait_for_workers=False)\nprint(s.port, flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    def freeze() -> None:
        # SIGSTOP takes effect once the process is scheduled: until then (a loaded machine) its store still answers,
        # and a test's first request went through (a CI run's "DID NOT RAISE", 2026-12-07). Wait for the stop.
        os.kill(server.pid, signal.SIGSTOP)
        await_stopped(server.pid, "the store's process")

    try:
        yield int(server.stdout.readline()), freeze
    finally:
        server.kill()  # SIGKILL ends a stopped process too
        server.wait(timeout=30)


def test_a_peer_s_address_is_not_waited_for_past_the_deadline_on_a_frozen_store(store):
    port, freeze = store
    client = store_client("127.0.0.1", port, timeout_s=5)  # connected while the store runs
    freeze()
    start = time.monotonic()
    with pytest.raises(PeerFailure, match="rendezvous store did not answer before the deadline"):
        peer_address(client, 1, deadline=time.monotonic() + 0.5, closed=threading.Event())
    assert time.monotonic() - start < 2.0
    closed = threading.Event()
    threading.Timer(0.3, closed.set).start()  # a doomed try's abort closes the transport meanwhile
    start = time.monotonic()
    with pytest.raises(PeerFailure, match="transport is closed"):
        peer_address(client, 1, deadline=time.monotonic() + 30, closed=closed)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
def test_a_send_to_a_peer_whose_address_a_frozen_store_holds_fails_at_its_deadline_and_close_returns(store, kind):
    from openprime.core.timeouts import Timeouts
    from openprime.train.config import TransportConfig, TransportKind
    from openprime.train.transports import transport_factory

    port, freeze = store
    factory = transport_factory(TransportConfig(kind=TransportKind(kind)), Timeouts(connect_s=1.0, op_s=1.0))
    transport = factory(Rendezvous(host="127.0.0.1", port=port, group="run/e1/s0/a0/l0"), 0, 2)
    freeze()  # the coordinator freezes before rank 1 (which never comes) published its address
    outcome = []

    def send():
        start = time.monotonic()
        try:
            transport.isend(1, 1, [torch.zeros(4)], deadline=time.monotonic() + 1.0).wait()
        except PeerFailure as e:
            outcome.append((time.monotonic() - start, e))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(timeout=10)
    assert outcome and outcome[0][0] < 4.0, outcome  # before: blocked until the store ran again
    closer = threading.Thread(target=transport.close, daemon=True)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
def test_a_group_built_on_a_frozen_store_fails_at_the_connect_timeout(store, kind):
    # The coordinator froze between its view and the group's building: the node hung in the transport's constructor
    # (the store's handshake is never answered). ElasticDeviceMesh turns the PeerFailure into a failed try.
    from openprime.core.timeouts import Timeouts
    from openprime.train.config import TransportConfig, TransportKind
    from openprime.train.transports import transport_factory

    port, freeze = store
    freeze()
    factory = transport_factory(TransportConfig(kind=TransportKind(kind)), Timeouts(connect_s=1.0, op_s=1.0))
    start = time.monotonic()
    with pytest.raises(PeerFailure, match="rendezvous store did not answer"):
        factory(Rendezvous(host="127.0.0.1", port=port, group="run/e1/s0/a0/l0"), 0, 2)
    assert time.monotonic() - start < 4.0
