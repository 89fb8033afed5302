"""The mailbox of the stream transports, driven directly: receives that add (Transport.irecv_add)."""

import time

import pytest
import torch

from openprime.core.errors import FrameError, PeerFailure
from openprime.core.frames import FrameHeader
from openprime.core.mailbox import Mailbox

PEER, TAG = 1, 5


def _deliver(mailbox: Mailbox, data: torch.Tensor, offset: int, length: int, *, seq: int = 0) -> None:
    """What a TCP connection does with one chunk: read it into the slice `target` gives, then say so."""
    header = FrameHeader(tag=TAG, seq=seq, sizes=(data.numel(),), offset=offset, length=length)
    token, region = mailbox.target(PEER, header, framed=length + 32)
    region.copy_(data[offset : offset + length])
    mailbox.delivered(PEER, header, token, framed=length + 32)


def _message(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


# (offset, length, arrives before the receive is posted) of the chunks of a 1000-float message, in arrival order.
ARRIVALS = {
    "posted first, chunks in any order": [(3200, 800, False), (0, 1600, False), (1600, 1600, False)],
    "a chunk before the receive": [(1600, 1600, True), (0, 1600, False), (3200, 800, False)],
}


@pytest.mark.parametrize("arrivals", ARRIVALS.values(), ids=ARRIVALS.keys())
def test_chunks_are_added_into_the_accumulator(arrivals):
    message, acc = _message(1000, 0), _message(1000, 1)
    expected = acc + message
    mailbox = Mailbox(max_unexpected_bytes=1 << 20)
    raw = message.view(torch.uint8)
    for offset, length, _ in [a for a in arrivals if a[2]]:
        _deliver(mailbox, raw, offset, length)  # early: kept aside, added when the receive is posted
    recv = mailbox.post(PEER, TAG, [torch.empty(1000)], time.monotonic() + 5, acc=acc)
    for offset, length, _ in [a for a in arrivals if not a[2]]:
        _deliver(mailbox, raw, offset, length)
    recv.wait()
    assert torch.equal(acc, expected)


def test_zeromq_adds_from_its_own_memory():
    """A connection that holds the payload (ZeroMQ) hands it to `delivered`, which adds it; the buffer is skipped."""
    message, acc = _message(64, 4), _message(64, 5)
    expected = acc + message
    mailbox = Mailbox(max_unexpected_bytes=1 << 20)
    buffer = torch.full((64,), float("nan"))
    recv = mailbox.post(PEER, TAG, [buffer], time.monotonic() + 5, acc=acc)
    header = FrameHeader(tag=TAG, seq=0, sizes=(256,), offset=0, length=256)
    token, _ = mailbox.target(PEER, header, framed=288)
    assert mailbox.adds(token)
    mailbox.delivered(PEER, header, token, framed=288, payload=message.view(torch.uint8).numpy())
    recv.wait()
    assert torch.equal(acc, expected)
    assert buffer.isnan().all()  # never written: the payload went straight into the accumulator


def test_a_chunk_not_aligned_to_fp32_is_refused_before_its_payload_is_read():
    mailbox = Mailbox(max_unexpected_bytes=1 << 20)
    mailbox.post(PEER, TAG, [torch.empty(10)], time.monotonic() + 5, acc=torch.zeros(10))
    with pytest.raises(FrameError, match="not aligned to 4 bytes"):
        mailbox.target(PEER, FrameHeader(tag=TAG, seq=0, sizes=(40,), offset=2, length=8), framed=40)


@pytest.mark.parametrize("how", ["peer lost", "deadline passed"])
def test_a_chunk_delivered_after_its_receive_failed_leaves_the_accumulator_alone(how):
    """Once the caller has seen the failure it may recompute the accumulator (a retry): late chunks must not land.
    A receive whose deadline passed was only forgotten, not failed: a chunk a connection had already matched to it
    was added after the caller saw the PeerFailure (ZeroMQ adds from its own memory; review of 2026-12-07)."""
    acc = torch.zeros(256)
    mailbox = Mailbox(max_unexpected_bytes=1 << 20)
    recv = mailbox.post(PEER, TAG, [torch.empty(256)], time.monotonic() + (5 if how == "peer lost" else 0.1), acc=acc)
    header = FrameHeader(tag=TAG, seq=0, sizes=(1024,), offset=0, length=512)
    token, region = mailbox.target(PEER, header, framed=544)  # a connection starts reading a chunk
    if how == "peer lost":
        mailbox.peer_lost(PEER, "connection ended without a goodbye: the peer died")
    with pytest.raises(PeerFailure, match="the peer died" if how == "peer lost" else "deadline passed"):
        recv.wait()
    region.copy_(torch.ones(128).view(torch.uint8))
    mailbox.delivered(PEER, header, token, framed=544)  # the chunk it was reading ends after the failure
    assert torch.equal(acc, torch.zeros(256))
    mailbox.delivered(PEER, header, token, framed=544, payload=torch.ones(128).view(torch.uint8).numpy())  # ZeroMQ's
    assert torch.equal(acc, torch.zeros(256))


def test_a_receive_posted_after_the_mailbox_failed_all_fails_at_once():
    """A close from another thread (a doomed try's abort) may land between irecv's check that the transport is open
    and its post: the receive must fail then, not wait out its deadline (2(n-1) x op_s in a ring)."""
    mailbox = Mailbox(max_unexpected_bytes=1 << 20)
    mailbox.fail_all("transport is closed")
    start = time.monotonic()
    recv = mailbox.post(PEER, TAG, [torch.empty(4)], start + 30)
    with pytest.raises(PeerFailure, match="transport is closed"):
        recv.wait()
    assert time.monotonic() - start < 1.0


def test_a_chunk_of_an_old_connection_read_across_its_peer_s_reset_is_dropped():
    """A chunk that arrived before its receive, still being read when its peer reconnected (sequence numbers restart
    at 0): the reset dropped it, and its delivery then raised ValueError in the connection's thread, or filled a
    receive of the new connection that had the same (tag, seq) with the old connection's bytes."""
    mailbox = Mailbox(max_unexpected_bytes=1 << 20)
    header = FrameHeader(tag=TAG, seq=0, sizes=(16,), offset=0, length=16)
    token, region = mailbox.target(PEER, header, framed=48)  # no receive posted yet: kept aside
    mailbox.peer_reset(PEER)  # the peer reconnected as a new generation
    fresh = torch.zeros(4)
    recv = mailbox.post(PEER, TAG, [fresh], time.monotonic() + 0.2)  # the new connection's message 0
    region.copy_(torch.full((4,), 7.0).view(torch.uint8))
    mailbox.delivered(PEER, header, token, framed=48)  # the old chunk's read ends now: no error
    assert torch.equal(fresh, torch.zeros(4)) and not recv.done
    new_token, new_region = mailbox.target(PEER, header, framed=48)  # the new connection's chunk fills it
    new_region.copy_(torch.ones(4).view(torch.uint8))
    mailbox.delivered(PEER, header, new_token, framed=48)
    recv.wait()
    assert torch.equal(fresh, torch.ones(4))


# A chunk that arrives before its receive is posted (a neighbour that starts the ring first; every all-gather whose
# sender is first) counts against max_unexpected_bytes until a receive claims it. Claimed at `post`, the count did
# not go down (a hand mutation left every test passing): over a run, once the early bytes of the transport's life
# passed max_unexpected_bytes (1 GiB), every early chunk was refused with a FrameError and the outer steps failed.
EARLY_PEER, EARLY_TAG = 1, 5


def _deliver_early(mailbox: Mailbox, raw: torch.Tensor, seq: int) -> None:
    header = FrameHeader(tag=EARLY_TAG, seq=seq, sizes=(raw.numel(),), offset=0, length=raw.numel())
    token, region = mailbox.target(EARLY_PEER, header, framed=raw.numel() + 32)
    region.copy_(raw)
    mailbox.delivered(EARLY_PEER, header, token, framed=raw.numel() + 32)


def test_early_chunks_taken_by_a_later_receive_are_no_longer_counted_as_unexpected():
    numel = 1000
    mailbox = Mailbox(max_unexpected_bytes=numel * 4)  # room for one early message at a time
    for seq in range(5):  # five messages in a row, each wholly there before its receive (FrameError before)
        message = torch.randn(numel, generator=torch.Generator().manual_seed(seq))
        _deliver_early(mailbox, message.view(torch.uint8), seq)
        out = torch.empty(numel)
        mailbox.post(EARLY_PEER, EARLY_TAG, [out], time.monotonic() + 5).wait()
        assert torch.equal(out, message)
    assert mailbox._unexpected_bytes == 0


def test_the_same_for_a_receive_that_adds():
    numel = 1000
    mailbox = Mailbox(max_unexpected_bytes=numel * 4)
    acc = torch.zeros(numel)
    for seq in range(5):
        _deliver_early(mailbox, torch.ones(numel).view(torch.uint8), seq)
        mailbox.post(EARLY_PEER, EARLY_TAG, [torch.empty(numel)], time.monotonic() + 5, acc=acc).wait()
    assert torch.equal(acc, torch.full((numel,), 5.0))
    assert mailbox._unexpected_bytes == 0


def test_a_chunk_still_arriving_when_its_receive_failed_does_not_hold_memory_for_good():
    """A chunk began to arrive before its receive was posted, and its read ended after the receive had failed (its
    deadline passed). It stayed in the store of early chunks, counted against max_unexpected_bytes: after a few, a
    healthy early message was refused as a flood (FrameError: the connection then taken for lost)."""
    mailbox = Mailbox(max_unexpected_bytes=3 << 20)
    for seq in range(4):
        header = FrameHeader(tag=TAG, seq=seq, sizes=(1 << 20,), offset=0, length=1 << 20)
        token, region = mailbox.target(PEER, header, framed=(1 << 20) + 32)  # early: its read begins
        recv = mailbox.post(PEER, TAG, [torch.empty(1 << 20, dtype=torch.uint8)], time.monotonic() + 0.05)
        with pytest.raises(PeerFailure):
            recv.wait()
        region.fill_(1)  # the rest of the chunk is read after the receive failed
        mailbox.delivered(PEER, header, token, framed=(1 << 20) + 32)
        assert mailbox._unexpected_bytes == 0
    _deliver(mailbox, torch.arange(256, dtype=torch.uint8), 0, 256, seq=4)  # a healthy early message
    out = torch.empty(256, dtype=torch.uint8)
    mailbox.post(PEER, TAG, [out], time.monotonic() + 5).wait()
    assert torch.equal(out, torch.arange(256, dtype=torch.uint8))
