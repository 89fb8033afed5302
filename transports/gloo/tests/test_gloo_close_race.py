"""A close from another thread (the abort of a doomed try, openprime.mesh.abort) may land between a send's or a
receive's check that the transport is open and its post to Gloo: the call must fail as a PeerFailure. Before, the
group was already gone (AttributeError on None), or a receive posted after the close waited out its deadline.
The TCP transport crashed the same way in tools/chaos.py (seed 21, 2026-12-05): test_tcp_close_race.py."""

import time

import pytest
import torch

from openprime.core.collectives import TAG_ALL_REDUCE
from openprime.core.distributed import host_store
from openprime.core.errors import PeerFailure
from openprime.core.testing import run_threads
from openprime.core.transport import Rendezvous
from openprime.transports.gloo import GlooTransportConfig, create_gloo_transport


@pytest.mark.parametrize("op", ["isend", "irecv"])
def test_a_call_overtaken_by_a_close_from_another_thread_raises_peer_failure(op):
    store = host_store(timeout_s=10)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group=f"close-race-{op}")
    config = GlooTransportConfig(connect_timeout_s=10)
    first, second = run_threads([lambda: create_gloo_transport(rendezvous, 0, 2, config),
                                 lambda: create_gloo_transport(rendezvous, 1, 2, config)])
    ready = first._ready

    def ready_then_closed(peer):
        ready(peer)
        first.close()  # the abort's close, from the watch thread, lands here

    try:
        first._ready = ready_then_closed
        start = time.monotonic()
        with pytest.raises(PeerFailure, match="transport is closed"):
            getattr(first, op)(1, TAG_ALL_REDUCE, [torch.ones(4)], deadline=start + 10).wait()
        assert time.monotonic() - start < 2.0
    finally:
        first.close()
        second.close()


def test_a_store_that_never_answers_fails_the_build_without_killing_its_thread(monkeypatch):
    # connect_store raises PeerFailure once a store that accepted the connection has not answered within its bound;
    # the build thread caught only RuntimeError, so it died with a traceback on stderr (seen as pytest's
    # PytestUnhandledThreadExceptionWarning in a CI log) and the failure's reason was lost.
    import socket
    import threading

    uncaught = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts into the backlog; nothing answers
    before = set(threading.enumerate())
    transport = create_gloo_transport(Rendezvous(host="127.0.0.1", port=silent.getsockname()[1], group="silent"),
                                      0, 2, GlooTransportConfig(connect_timeout_s=0.5))
    try:
        (build,) = [t for t in threading.enumerate() if t not in before and t.name.startswith("openprime-gloo-build")]
        build.join(timeout=10)  # connect_store's bound: connect_timeout_s and a second
        assert not build.is_alive()
        assert uncaught == []
        assert "the rendezvous store did not answer" in transport._build_error
    finally:
        transport.close()
        silent.close()
