"""A close from another thread (the abort of a doomed try, openprime.mesh.abort) may land between a send's
connect and its dealing of chunks to the connection's writers: the send must fail as a PeerFailure, which the
callers handle, not with another error.

tools/chaos.py (seed 21, 2 local ranks, tcp, non-blocking recovery, 2026-12-05) hit it: the send found the
writers gone and raised ZeroDivisionError (`turn % len(writers)`), and the two nodes that still held the run's
state crashed; every node after them was refused. The zmq transport already checked its link under the lock.
"""

import time

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


def test_a_send_overtaken_by_a_close_from_another_thread_raises_peer_failure():
    store = host_store(timeout_s=10)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="close-race")
    sender, receiver = run_threads([lambda: TcpTransport(rendezvous, 0, 2, CONFIG),
                                    lambda: TcpTransport(rendezvous, 1, 2, CONFIG)])
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
