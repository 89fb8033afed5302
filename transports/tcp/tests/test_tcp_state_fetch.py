"""A state fetch whose donor timed out leaves receives posted on its transport: closed, they cannot write into the
state a later fetch checked.

The TCP transport fills a posted receive as its bytes arrive. A joiner keeps IN_FLIGHT chunk receives posted; when
one passes its deadline the fetch fails, and the others stay posted. On the same transport they were filled when the
slow donor's bytes came after all: in chunks that the next donor had sent and that had passed their checksums and
the state hash (found by a review, 2026-12-07; over zmq too). The contract (StateFetch.fetch): close the transport
of a failed fetch before the next one, as DiLoCo does (a failed try closes its group; a non-blocking joiner's
failed receive abandons it, which it did not before).
"""

import contextlib
import threading
import time

import pytest
import torch

from openprime.core import digest
from openprime.core.distributed import host_store
from openprime.core.errors import PeerFailure
from openprime.core.state_transfer import TAG_STATE, StateFetch, StateOffer, send_state
from openprime.core.streams import StreamTransportConfig
from openprime.core.testing import ForwardingTransport, run_threads
from openprime.core.transport import Rendezvous, as_bytes
from openprime.transports.tcp import TcpTransport

CHUNK, PIECE = 1000, 500
_STORES = []  # the rendezvous stores, alive while the transports' connections look their peers up


def _group(n: int, name: str) -> list[TcpTransport]:
    store = host_store(timeout_s=10)
    _STORES.append(store)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group=name)
    config = StreamTransportConfig(connect_timeout_s=5, num_connections=1)
    return run_threads([lambda r=r: TcpTransport(rendezvous, r, n, config) for r in range(n)])


def _offer(step: int, origin: str, seed: int) -> StateOffer:
    g = torch.Generator().manual_seed(seed)
    shared = {"theta": torch.randn(1500, generator=g), "momentum": torch.randn(700, generator=g)}
    own = {"exp_avg": torch.randn(30, 20, generator=g)}
    state_hash = digest.region_hash([as_bytes(t) for t in shared.values()], piece_bytes=PIECE)
    return StateOffer(step=step, origin=origin, state_hash=state_hash, shared=shared, own=own, meta={"step": step},
                      chunk_bytes=CHUNK, piece_bytes=PIECE)


class _Freezes(ForwardingTransport):
    """A donor that stops (no error) before its third state chunk until released, then sends the rest."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.count, self.released = 0, threading.Event()

    def isend(self, peer, tag, buffers, *, deadline):
        if tag == TAG_STATE:
            if self.count == 2:
                self.released.wait(timeout=30)
            self.count += 1
        return super().isend(peer, tag, buffers, deadline=deadline)


def test_late_chunks_of_a_donor_that_timed_out_do_not_land_in_the_next_donors_checked_state():
    a, b, joiner = _group(3, "late-chunks")
    again = []
    try:
        theta, momentum = torch.zeros(1500), torch.zeros(700)
        fetch = StateFetch(targets={"theta": theta, "momentum": momentum})
        slow = _Freezes(a)
        sender = threading.Thread(target=lambda: _quietly(send_state, slow, 2, _offer(3, "A@1", seed=3),
                                                          deadline=time.monotonic() + 30, op_s=5.0), daemon=True)
        sender.start()
        with pytest.raises(PeerFailure):  # the frozen donor's chunk passes its deadline
            fetch.fetch(joiner, 0, deadline=time.monotonic() + 30, op_s=0.1)
        assert sorted(fetch.received) == [0, 1]
        joiner.close()  # as DiLoCo closes the group of a failed fetch; the next outer step builds a new one
        again = _group(2, "late-chunks-again")
        newer = _offer(4, "B@2", seed=4)  # the next outer step's state, from another donor
        _, complete = run_threads([lambda: send_state(again[0], 1, newer, deadline=time.monotonic() + 30),
                                   lambda: fetch.fetch(again[1], 0, deadline=time.monotonic() + 30, op_s=1.0)])
        assert complete and torch.equal(theta, newer.tensors["theta"])
        slow.released.set()  # the first donor's late chunks go out
        sender.join(10)
        time.sleep(0.5)
        assert torch.equal(theta, newer.tensors["theta"]) and torch.equal(momentum, newer.tensors["momentum"])
        assert torch.equal(fetch.tensors["exp_avg"], newer.tensors["exp_avg"])
    finally:
        for t in (a, b, joiner, *again):
            t.close()


def _quietly(send, *args, **kwargs) -> None:
    with contextlib.suppress(PeerFailure):  # its joiner gave up on it
        send(*args, **kwargs)
