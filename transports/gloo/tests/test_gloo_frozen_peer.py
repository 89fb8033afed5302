"""A peer that published its address and then froze (SIGSTOP: a hung process; a firewall that drops its packets
looks the same) can hold Gloo's group set-up 5 x its timeout (10 s for 2 s, torch 2.13), inside a C++
constructor that nothing interrupts. The transport builds its group on a thread of its own: an operation fails at the
transport's `connect_timeout_s`, and a close from another thread (a doomed try's abort) fails it at once.
tools/chaos.py seed 31 (2026-12-06) saw a node whose processes were still inside that constructor 30 s after its
final SIGTERM, with a 10 s connect timeout."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from openprime.core.collectives import TAG_ALL_REDUCE
from openprime.core.distributed import host_store
from openprime.core.errors import PeerFailure
from openprime.core.transport import Rendezvous
from openprime.transports.gloo import GlooTransportConfig, create_gloo_transport
from openprime.transports.gloo import transport as gloo_transport

CONNECT_TIMEOUT_S = 2.0
# Rank 1, in a process of its own: builds its side of the group (it publishes its address, then waits for rank 0's).
PEER = """
import sys, time
from openprime.core.transport import Rendezvous
from openprime.transports.gloo import GlooTransportConfig, create_gloo_transport
create_gloo_transport(Rendezvous(host="127.0.0.1", port=int(sys.argv[1]), group=sys.argv[2]), 1, 2,
                      GlooTransportConfig(connect_timeout_s=60))
time.sleep(120)
"""


@pytest.fixture
def frozen_peer():
    """A rendezvous where rank 1 published its Gloo address and then froze."""
    store = host_store(timeout_s=30)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="frozen-peer")
    keys_before = store.num_keys()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), rendezvous.group],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while store.num_keys() == keys_before:  # Gloo's address key of rank 1
            assert peer.poll() is None and time.monotonic() < deadline, "rank 1 never published its address"
            time.sleep(0.05)
        peer.send_signal(signal.SIGSTOP)
        yield rendezvous
    finally:
        peer.kill()
        peer.wait(timeout=30)


@pytest.mark.timeout(60)
def test_an_operation_fails_at_the_connect_timeout_while_gloo_goes_on_building(monkeypatch):
    # Whether Gloo's constructor is still connecting to the frozen peer at the connect timeout, or already built a
    # group with it (its handshake can complete while the peer is stopped), is a race; a constructor that outlasts
    # its timeout stands in here for the first case.
    release = threading.Event()

    def gloo_group_that_outlasts_its_timeout(store, rank, world_size, *, timeout_s, host):
        release.wait(30)
        raise RuntimeError("Gloo connectFullMesh failed with [pair.h:311] Connect timeout [none]")

    monkeypatch.setattr(gloo_transport, "gloo_group", gloo_group_that_outlasts_its_timeout)
    store = host_store(timeout_s=30)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="outlasting")
    start = time.monotonic()
    transport = create_gloo_transport(rendezvous, 0, 2, GlooTransportConfig(connect_timeout_s=CONNECT_TIMEOUT_S))
    try:
        assert time.monotonic() - start < 0.5, "the factory waited for the group"
        with pytest.raises(PeerFailure, match=r"not built within connect_timeout_s=2"):
            transport.irecv(1, TAG_ALL_REDUCE, [torch.empty(4)], deadline=start + 60).wait()
        took = time.monotonic() - start
        assert CONNECT_TIMEOUT_S - 0.1 <= took < CONNECT_TIMEOUT_S + 1.0, took
        with pytest.raises(PeerFailure, match="broken"):  # as after any failure: the group is rebuilt, not reused
            transport.isend(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=time.monotonic() + 60)
    finally:
        release.set()
        transport.close()


@pytest.mark.timeout(60)
def test_a_close_from_another_thread_fails_an_operation_waiting_for_the_group(frozen_peer):
    start = time.monotonic()
    transport = create_gloo_transport(frozen_peer, 0, 2, GlooTransportConfig(connect_timeout_s=30))
    assert time.monotonic() - start < 0.5, "the factory waited for the group"
    closer = threading.Timer(0.5, transport.close)  # a doomed try's abort, from the watch thread
    start = time.monotonic()
    closer.start()
    try:
        # Before the group is built ("transport is closed") or after, with the send posted to the frozen peer.
        with pytest.raises(PeerFailure, match="transport is closed|transport closed"):
            transport.isend(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=start + 60).wait()
        assert time.monotonic() - start < 1.5
    finally:
        closer.cancel()
        transport.close()
