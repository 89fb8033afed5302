"""Live recovery transfers: chunked, checked, resumable from another donor (openprime.core.state_transfer)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from openprime.core import digest, state_transfer
from openprime.core.errors import PeerFailure
from openprime.core.state_transfer import (
    CHUNK_BYTES,
    IN_FLIGHT,
    TAG_STATE,
    StateCorrupt,
    StateFetch,
    StateOffer,
    default_chunk_bytes,
    num_messages,
    send_state,
)
from openprime.core.testing import ForwardingTransport, local_group, run_threads
from openprime.core.transport import Handle, Transport, as_bytes

CHUNK, PIECE = 1000, 500  # bytes: small, so that chunks and pieces span tensor boundaries


def shared_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"theta": torch.randn(1500, generator=g), "momentum": torch.randn(700, generator=g)}


def own_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {"exp_avg": torch.randn(30, 20, generator=g), "step": torch.tensor(7.0 + seed),
            "position": torch.arange(5, dtype=torch.int64) * seed}


def state_hash(shared: dict[str, torch.Tensor]) -> str:
    return digest.region_hash([as_bytes(t) for t in shared.values()], piece_bytes=PIECE)


def offer(origin: str, seed: int, **kw) -> StateOffer:
    kw = {"state_hash": state_hash(shared_state()), **kw}
    return StateOffer(step=3, origin=origin, shared=shared_state(), own=own_state(seed),
                      meta={"num_inner_steps_done": 60}, chunk_bytes=CHUNK, piece_bytes=PIECE, **kw)


class DiesAfter(ForwardingTransport):
    """A donor's transport that stops sending (a killed process) after `num_chunks` state chunks."""

    def __init__(self, inner: Transport, num_chunks: int, corrupt: int | None = None, header: bool = False) -> None:
        super().__init__(inner)
        self.left, self.corrupt, self.count, self.header = num_chunks, corrupt, 0, header

    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        if tag == TAG_STATE:
            if self.left == 0:
                raise PeerFailure(peer, "this donor was killed")
            self.left -= 1
            self.count += 1
            if self.count == self.corrupt:  # one bit flipped on the wire: in the chunk's bytes, or in its index
                buffers = [b.clone() for b in buffers]
                buffers[0 if self.header else -1].view(torch.uint8)[0] ^= 1
        return super().isend(peer, tag, buffers, deadline=deadline)


def test_a_transfer_delivers_every_tensor_into_place():
    donor_t, joiner_t = local_group(2)
    theta_target = torch.zeros(1500)
    fetch = StateFetch(targets={"theta": theta_target})
    deadline = time.monotonic() + 30
    report, complete = run_threads([lambda: send_state(donor_t, 1, offer("A", 1), deadline=deadline),
                                    lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert complete and fetch.step == 3 and fetch.header["meta"] == {"num_inner_steps_done": 60}
    assert fetch.tensors["theta"] is theta_target  # received in place, no copy
    for name, t in {**shared_state(), **own_state(1)}.items():
        assert torch.equal(fetch.tensors[name], t), name
    # Shared bytes (8800) and own bytes (2444) are each cut from their own start: 9 + 3 chunks.
    total = sum(t.numel() * t.element_size() for t in {**shared_state(), **own_state(1)}.values())
    assert report.num_bytes == total and report.num_chunks == 9 + 3 == fetch.num_chunks_fetched
    assert digest.combine(fetch.shared_digests()) == state_hash(shared_state())


@pytest.mark.parametrize("dies_in", ["shared", "own"])
def test_a_dead_donor_is_replaced_and_only_the_missing_chunks_travel(dies_in):
    """The first donor dies after 4 chunks (all of the shared state, which holds for any donor), or after the whole
    shared state and one chunk of its own state (an inner optimizer's moments): that one is fetched again from the
    second donor, or the joiner's own state would be two donors' mixed, which no hash covers."""
    a, b, joiner = local_group(3)
    fetch = StateFetch()
    layout = offer("B", 2).layout
    num_shared = sum(layout.is_shared(i) for i in range(layout.num_chunks))
    sent = 4 if dies_in == "shared" else num_shared + 1
    short = time.monotonic() + 1.0
    with pytest.raises(PeerFailure):
        run_threads([lambda: send_state(DiesAfter(a, sent), 2, offer("A", 1), deadline=short),
                     lambda: fetch.fetch(joiner, 0, deadline=short)])
    assert len(fetch.received) == sent and not fetch.complete  # what arrived before the kill is kept
    kept = {i for i in fetch.received if layout.is_shared(i)}
    assert len(kept) == (sent if dies_in == "shared" else num_shared)
    deadline = time.monotonic() + 30
    report, complete = run_threads([lambda: send_state(b, 2, offer("B", 2), deadline=deadline),
                                    lambda: fetch.fetch(joiner, 1, deadline=deadline)])
    assert complete and report.num_chunks == layout.num_chunks - len(kept)
    for name, t in {**shared_state(), **own_state(2)}.items():  # the own state is the second donor's, whole
        assert torch.equal(fetch.tensors[name], t), name


def test_a_second_donor_offering_another_state_of_the_same_step_is_fetched_whole():
    """The first donor dies; the second offers the same step and layout but another state (another hash: a
    replica that drifted, or a state from another timeline). Nothing of the first is kept: keeping its shared
    chunks would build a state of neither, caught only by the whole state's hash after a full transfer."""
    a, b, joiner = local_group(3)
    fetch = StateFetch()
    short = time.monotonic() + 1.0
    with pytest.raises(PeerFailure):
        run_threads([lambda: send_state(DiesAfter(a, 4), 2, offer("A", 1), deadline=short),
                     lambda: fetch.fetch(joiner, 0, deadline=short)])
    assert len(fetch.received) == 4
    other = shared_state(seed=5)
    second = StateOffer(step=3, origin="B", shared=other, own=own_state(2), meta={"num_inner_steps_done": 60},
                        chunk_bytes=CHUNK, piece_bytes=PIECE, state_hash=state_hash(other))
    deadline = time.monotonic() + 30
    report, complete = run_threads([lambda: send_state(b, 2, second, deadline=deadline),
                                    lambda: fetch.fetch(joiner, 1, deadline=deadline)])
    assert complete and fetch.num_corrupt == 0 and report.num_chunks == second.layout.num_chunks
    for name, t in {**other, **own_state(2)}.items():
        assert torch.equal(fetch.tensors[name], t), name


class Paced(ForwardingTransport):
    """A donor's link that carries a state chunk every `delay_s`, and none after `stall_after` chunks (a donor
    whose process froze: no error, no close) until `released`."""

    def __init__(self, inner: Transport, delay_s: float, stall_after: int | None = None) -> None:
        super().__init__(inner)
        self.delay_s, self.stall_after, self.count = delay_s, stall_after, 0
        self.released = threading.Event()

    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        if tag == TAG_STATE:
            if self.count == self.stall_after:
                self.released.wait(timeout=30)
                raise PeerFailure(peer, "this donor was frozen")
            self.count += 1
            time.sleep(self.delay_s)
        return super().isend(peer, tag, buffers, deadline=deadline)


def test_with_op_s_a_transfer_that_moves_outlasts_its_deadline_and_one_that_stalls_fails_within_a_few_op_s():
    # 12 chunks, one every 0.08 s: about 1 s, twice the 0.5 s deadline, which bounds only the offer and the
    # answer; each chunk has IN_FLIGHT x op_s = 0.9 s from when it is posted.
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    start = time.monotonic()
    deadline = start + 0.5
    report, complete = run_threads([
        lambda: send_state(Paced(donor_t, 0.08), 1, offer("A", 1), deadline=deadline, op_s=0.3),
        lambda: fetch.fetch(joiner_t, 0, deadline=deadline, op_s=0.3)])
    assert complete and report.num_chunks == 12 and time.monotonic() - start > 0.9
    # Without op_s the same transfer is cut at its deadline.
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    deadline = time.monotonic() + 0.5
    with pytest.raises(PeerFailure, match="deadline"):
        run_threads([lambda: send_state(Paced(donor_t, 0.08), 1, offer("A", 1), deadline=deadline),
                     lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert 0 < len(fetch.received) < 12
    # A donor that stops sending after 5 chunks: the joiner gives up within about IN_FLIGHT x op_s of the last
    # chunk, not at the far deadline, and keeps the 5 chunks for the next donor.
    donor_t, joiner_t = local_group(2)
    fetch, frozen = StateFetch(), Paced(donor_t, 0.0, stall_after=5)
    deadline = time.monotonic() + 60
    outcome = {}

    def joiner():
        start = time.monotonic()
        with pytest.raises(PeerFailure, match="deadline"):
            fetch.fetch(joiner_t, 0, deadline=deadline, op_s=0.3)
        outcome["gave up after"] = time.monotonic() - start
        frozen.released.set()

    def donor():
        with pytest.raises(PeerFailure, match="frozen"):
            send_state(frozen, 1, offer("A", 1), deadline=deadline, op_s=0.3)

    run_threads([donor, joiner])
    assert IN_FLIGHT * 0.3 - 0.05 < outcome["gave up after"] < 3.0 and fetch.received == set(range(5))


def test_a_transfer_s_messages_are_its_chunks_and_the_offer_and_answer():
    assert num_messages(100 << 20, 0) == 4 + 8  # under 8 x 64 MiB: 8 chunks
    assert num_messages(20 << 30, 20 << 30) == 4 + 2 * 320  # chunks of 64 MiB
    state = {**shared_state(), **own_state(1)}
    shared_bytes = sum(t.nbytes for t in shared_state().values())
    layout = StateOffer(step=0, origin="A", state_hash="h", shared=shared_state(), own=own_state(1)).layout
    assert num_messages(shared_bytes, sum(t.nbytes for t in state.values()) - shared_bytes) == 4 + layout.num_chunks


@pytest.mark.parametrize("where", ["bytes", "header"])
def test_a_corrupt_chunk_is_detected_and_fetched_again(where):
    """A bit flipped in a chunk's bytes, or in the index of its header (which failed the whole transfer's try
    before 2026-12-07): that chunk is left missing, the others are kept, and the next offer sends it alone."""
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    deadline = time.monotonic() + 30
    donor = DiesAfter(donor_t, 10**6, corrupt=2, header=where == "header")
    report, complete = run_threads([lambda: send_state(donor, 1, offer("A", 1), deadline=deadline),
                                    lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert not complete and fetch.num_corrupt == 1 and 1 not in fetch.received
    assert fetch.received == set(range(report.num_chunks)) - {1}
    report, complete = run_threads([lambda: send_state(donor_t, 1, offer("A", 1), deadline=deadline),
                                    lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert complete and report.num_chunks == 1
    assert torch.equal(fetch.tensors["theta"], shared_state()["theta"])


def test_later_asks_for_nothing_now_and_a_new_step_starts_over():
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    deadline = time.monotonic() + 30
    report, complete = run_threads([lambda: send_state(donor_t, 1, offer("A", 1), deadline=deadline),
                                    lambda: fetch.fetch(joiner_t, 0, deadline=deadline, later=True)])
    assert report.later and report.num_chunks == 0 and not complete
    newer = StateOffer(step=4, origin="A", state_hash=state_hash(shared_state(5)), shared=shared_state(5),
                       chunk_bytes=CHUNK, piece_bytes=PIECE)
    run_threads([lambda: send_state(donor_t, 1, newer, deadline=deadline),
                 lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert fetch.complete and fetch.step == 4 and set(fetch.tensors) == {"theta", "momentum"}
    assert torch.equal(fetch.tensors["momentum"], shared_state(5)["momentum"])


def test_an_offer_that_is_not_the_agreed_state_is_refused():
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    deadline = time.monotonic() + 30
    outcome = {}

    def joiner():
        with pytest.raises(StateCorrupt, match="offered a state hashing to h3, not the h-agreed the members agreed"):
            fetch.fetch(joiner_t, 0, deadline=deadline, expected_hash="h-agreed")
        outcome["refused"] = True

    report, _ = run_threads([lambda: send_state(donor_t, 1, offer("A", 1, state_hash="h3"), deadline=deadline), joiner])
    assert outcome["refused"] and report.num_chunks == 0 and not fetch.received  # the donor was not left waiting


def test_an_offer_of_no_shared_state_is_refused():
    """A donor offering no global weights (only its own tensors, or nothing): the fetch was complete at once and
    the joiner went on with no state. It is refused, and the donor is answered rather than left waiting."""
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    deadline = time.monotonic() + 30
    empty = StateOffer(step=3, origin="A", state_hash=state_hash({}), shared={}, own=own_state(1), chunk_bytes=CHUNK,
                       piece_bytes=PIECE)
    outcome = {}

    def joiner():
        with pytest.raises(StateCorrupt, match="donor 0 offered no shared state .no global weights.; refused"):
            fetch.fetch(joiner_t, 0, deadline=deadline)
        outcome["refused"] = True

    report, _ = run_threads([lambda: send_state(donor_t, 1, empty, deadline=deadline), joiner])
    assert outcome["refused"] and report.num_chunks == 0 and not fetch.complete


@pytest.mark.parametrize("answer", [[1, 2], {"chunks": None}, {"chunks": ["x"]}, {"chunks": [0, 0]}])
def test_a_malformed_answer_to_an_offer_is_state_corrupt_for_the_donor(answer):
    """A joiner's answer that is msgpack but not {"chunks": [distinct indices]}: the donor raised AttributeError,
    TypeError or ValueError, which neither a try (blocking) nor a background send (non-blocking) handles."""
    donor_t, joiner_t = local_group(2)
    deadline = time.monotonic() + 30

    def joiner():
        state_transfer._recv_packed(joiner_t, 0, state_transfer.TAG_STATE_OFFER, deadline, 1 << 20)
        state_transfer._send_packed(joiner_t, 0, state_transfer.TAG_STATE_WANT, answer, deadline)

    def donor():
        with pytest.raises(StateCorrupt, match="peer 1 (answered the state offer with a malformed request|asked)"):
            send_state(donor_t, 1, offer("A", 1), deadline=deadline)

    run_threads([donor, joiner])


def test_a_small_state_is_cut_into_several_chunks_and_a_large_one_into_chunks_of_chunk_bytes():
    # The debug model's state (29.4 MB): chunks of 4 MiB (whole 1 MiB pieces), 8 of them, not one.
    assert default_chunk_bytes(29_386_248) == 4 << 20
    assert default_chunk_bytes(1_610_000_000) == CHUNK_BYTES
    assert default_chunk_bytes(5000) == digest.PIECE_BYTES
    big = StateOffer(step=1, origin="A", state_hash="h", shared={"theta": torch.zeros(3 << 20)})  # 12 MiB
    assert big.header["chunk_bytes"] == 2 << 20 and big.layout.num_chunks == 6


def test_a_whole_state_that_is_not_the_offered_one_is_fetched_again():
    """Every chunk matches the checksum the donor sent, but the shared tensors are not the state the offer names
    (a donor whose state changed under its hash): the fetch checks the whole against the offer's hash."""
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    deadline = time.monotonic() + 30
    wrong = offer("A", 1, state_hash=state_hash(shared_state(9)))
    run_threads([lambda: send_state(donor_t, 1, wrong, deadline=deadline),
                 lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert fetch.num_chunks_fetched == wrong.layout.num_chunks and fetch.num_corrupt == 1
    assert not fetch.complete and not fetch.received  # all of it is fetched again from the next offer
    report, complete = run_threads([lambda: send_state(donor_t, 1, offer("A", 1), deadline=deadline),
                                    lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert complete and report.num_chunks == wrong.layout.num_chunks and fetch.num_corrupt == 1


def test_a_donor_sends_the_digests_it_hashed_its_state_with_and_stale_ones_are_caught():
    shared = shared_state()
    digests = digest.piece_digests([as_bytes(t) for t in shared.values()], piece_bytes=PIECE)
    assert len(digests) == -(-8800 // PIECE)
    with pytest.raises(ValueError, match="has 3 digests where the shared tensors have 18 pieces of 500 bytes"):
        offer("A", 1, shared_digests=digests[:3])
    donor_t, joiner_t = local_group(2)
    deadline = time.monotonic() + 30
    fetch = StateFetch()
    _, complete = run_threads([lambda: send_state(donor_t, 1, offer("A", 1, shared_digests=digests), deadline=deadline),
                               lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert complete and fetch.num_corrupt == 0 and (fetch.shared_digests() == digests).all()
    stale = digests.copy()
    stale[4] ^= 1  # the digests of a state the donor has since changed: chunk 2 holds piece 4
    fetch = StateFetch()
    run_threads([lambda: send_state(donor_t, 1, offer("A", 1, shared_digests=stale), deadline=deadline),
                 lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    assert fetch.num_corrupt == 1 and fetch.received == set(range(12)) - {2}


def test_a_long_transfer_says_how_far_it_is(monkeypatch, caplog):
    monkeypatch.setattr(state_transfer, "PROGRESS_EVERY_S", 0.0)  # every chunk but the last, here
    caplog.set_level(logging.INFO, logger="openprime.core.state_transfer")
    donor_t, joiner_t = local_group(2)
    fetch = StateFetch()
    deadline = time.monotonic() + 30
    run_threads([lambda: send_state(donor_t, 1, offer("A", 1), deadline=deadline),
                 lambda: fetch.fetch(joiner_t, 0, deadline=deadline)])
    total = sum(t.nbytes for t in {**shared_state(), **own_state(1)}.values())
    lines = [r.getMessage() for r in caplog.records]
    received = [line for line in lines if line.startswith("receiving the state from rank 0: ")]
    sent = [line for line in lines if line.startswith("sending the state to rank 1: ")]
    assert len(received) == len(sent) == 11  # 12 chunks; the last one is the end, not progress
    assert received[0].startswith(f"receiving the state from rank 0: 0.0 of {total / 1e6:.1f} MB (")
    assert " MB/s, about " in received[-1] and received[-1].endswith("s left")
