"""Bad input from a raw ZeroMQ DEALER: each malformed frame is refused, logged with the peer and what was
wrong, answered with a refusal, and the transport goes on serving its other peers. Nothing is allocated at
a size the peer chose beyond max_frame_bytes (libzmq drops a connection that announces a larger part)."""

import time

import msgpack
import pytest
import torch
import zmq

from openprime.core import auth
from openprime.core.distributed import host_store
from openprime.core.errors import PeerFailure
from openprime.core.frames import MAGIC, PREFIX, PREFIX_BYTES, VERSION, decode_control, encode_control, encode_header
from openprime.core.streams import StreamTransportConfig
from openprime.core.testing import run_threads
from openprime.core.transport import Rendezvous
from openprime.transports.zmq import ZmqTransport

MAX_FRAME = 1 << 20
# Rank 1 is the raw socket: it never publishes an address, so the transports' own connections to it just
# wait (close() stops them); a long connect timeout keeps them from declaring rank 1 lost mid-test.
CONFIG = StreamTransportConfig(connect_timeout_s=30, max_frame_bytes=MAX_FRAME, num_connections=2)
TAG = 5


def _raw_header(obj: object, kind: int = 0) -> bytes:
    body = msgpack.packb(obj)
    return PREFIX.pack(MAGIC, VERSION, kind, len(body)) + body


GOOD_HEADER = encode_header(TAG, [4])
BAD_FRAMES = {  # message parts -> what the refusal must say
    "wrong magic": ([b"EVIL" + GOOD_HEADER[4:], b"abcd"], "wrong magic"),
    "wrong version": ([PREFIX.pack(MAGIC, VERSION + 7, 0, 0)], "unsupported frame version"),
    "unknown kind": ([PREFIX.pack(MAGIC, VERSION, 9, 0)], "unknown frame kind 9"),
    "shorter than a prefix": ([GOOD_HEADER[:5]], "truncated prefix (5 of 8 bytes)"),
    "prefix only": ([GOOD_HEADER[:PREFIX_BYTES]], f"truncated header (0 of {len(GOOD_HEADER) - PREFIX_BYTES} bytes)"),
    "header cut short": ([GOOD_HEADER[:-3], b"abcd"], "truncated header"),
    "header with stray bytes": ([GOOD_HEADER + b"xx", b"abcd"], "2 stray bytes after a header"),
    "oversized claim": ([encode_header(TAG, [MAX_FRAME + 1]), b""], f"exceeds max_frame_bytes={MAX_FRAME}"),
    "garbage msgpack": ([PREFIX.pack(MAGIC, VERSION, 0, 4) + b"\xc1\xc1\xc1\xc1", b""], "not valid msgpack"),
    "unknown tag": ([_raw_header({"tag": 1 << 20, "seq": 0, "sizes": [1], "off": 0, "len": 1}), b"x"],
                    "unknown tag"),
    "not a data header": ([_raw_header({"hello": "world"}), b""], "data header must have keys"),
    "payload shorter than declared": ([GOOD_HEADER, b"ab"], "payload of 2 bytes, the header says 4"),
    "no payload part": ([GOOD_HEADER], "data frame without its payload part"),
    "extra parts": ([GOOD_HEADER, b"abcd", b"more"], "message of 3 parts"),
    "hello after the handshake": ([encode_control(auth.hello(CONFIG.auth, rank=1, to=0, conn=0, incarnation="x",
                                                             generation=2, nonce=b"n" * 16))],
                                  "handshake frame after the handshake"),
}


@pytest.fixture
def group():
    """Rank 0 under test and rank 2 a well-behaved peer (threads of this process); rank 1 is raw sockets."""
    store = host_store(timeout_s=10)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="bad-frames")
    built = run_threads([lambda: ZmqTransport(rendezvous, 0, 3, CONFIG),
                         lambda: ZmqTransport(rendezvous, 2, 3, CONFIG)])
    ctx = zmq.Context()
    yield built, ctx
    for t in built:
        t.close()
    ctx.destroy(linger=0)


def _read_control(sock: zmq.Socket) -> dict:
    assert sock.poll(5000), "no answer from the transport"
    (frame,) = sock.recv_multipart()
    return decode_control(frame[PREFIX_BYTES:], "transport")


def _raw_peer(ctx: zmq.Context, transport: ZmqTransport, *, handshake: bool = True,
              incarnation: str = "raw") -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(transport.endpoint)
    if handshake:
        sock.send(encode_control(auth.hello(CONFIG.auth, rank=1, to=0, conn=0, incarnation=incarnation,
                                            generation=1, nonce=auth.new_nonce())))
        assert _read_control(sock) == {"op": "ok"}
    return sock


def _wait_for_refusals(transport: ZmqTransport, count: int) -> list[tuple[str, str]]:
    deadline = time.monotonic() + 5
    while len(transport.refusals) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(transport.refusals)


def _still_serves(under_test: ZmqTransport, good: ZmqTransport) -> None:
    """Messages flow both ways between the transport under test and its well-behaved peer."""
    deadline = time.monotonic() + 10
    got_here, got_there = torch.zeros(3), torch.zeros(2, dtype=torch.int64)
    run_threads([lambda: good.send(0, TAG, [torch.tensor([1.0, 2.0, 3.0])], deadline=deadline),
                 lambda: under_test.recv(2, TAG, [got_here], deadline=deadline),
                 lambda: under_test.send(2, TAG, [torch.tensor([7, 8])], deadline=deadline),
                 lambda: good.recv(0, TAG, [got_there], deadline=deadline)], timeout_s=15)
    assert got_here.tolist() == [1.0, 2.0, 3.0] and got_there.tolist() == [7, 8]


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frame_is_refused_and_others_are_served(group, case):
    (under_test, good), ctx = group
    parts, reason = BAD_FRAMES[case]
    raw = _raw_peer(ctx, under_test)
    raw.send_multipart(parts)
    (addr, why), = _wait_for_refusals(under_test, 1)
    assert reason in why and "rank 1" in why, why
    assert addr.startswith("127.0.0.1 "), addr
    answer = _read_control(raw)
    assert answer["op"] == "refused" and reason in answer["reason"], answer
    # Receives from the peer that sent it fail at once, and its later frames are dropped unheard.
    with pytest.raises(PeerFailure, match="invalid frame"):
        under_test.recv(1, TAG, [torch.zeros(4, dtype=torch.uint8)], deadline=time.monotonic() + 5)
    raw.send_multipart([GOOD_HEADER, b"abcd"])
    _still_serves(under_test, good)
    assert len(under_test.refusals) == 1, under_test.refusals


def test_data_without_handshake_is_refused(group):
    (under_test, good), ctx = group
    raw = _raw_peer(ctx, under_test, handshake=False)
    raw.send_multipart([GOOD_HEADER, b"abcd"])
    (addr, why), = _wait_for_refusals(under_test, 1)
    assert "127.0.0.1 (connection " in why and "unauthenticated" in why and "data before the handshake" in why, why
    assert _read_control(raw)["op"] == "refused"
    _still_serves(under_test, good)


def test_anything_but_a_hello_first_is_refused(group):
    (under_test, good), ctx = group
    raw = _raw_peer(ctx, under_test, handshake=False)
    raw.send(encode_control({"op": "auth", "proof": b"x" * 32}))
    (_, why), = _wait_for_refusals(under_test, 1)
    assert "expected a hello" in why, why
    _still_serves(under_test, good)


def test_hello_for_another_rank_is_refused(group):
    (under_test, _), ctx = group
    raw = _raw_peer(ctx, under_test, handshake=False)
    raw.send(encode_control(auth.hello(CONFIG.auth, rank=1, to=2, conn=0, incarnation="raw", generation=1,
                                       nonce=auth.new_nonce())))
    (_, why), = _wait_for_refusals(under_test, 1)
    assert "peer wanted rank 2 but reached rank 0" in why, why
    assert _read_control(raw)["op"] == "refused"


def test_good_frames_from_a_raw_peer_arrive_and_a_new_incarnation_recovers(group):
    (under_test, good), ctx = group
    raw = _raw_peer(ctx, under_test)
    raw.send_multipart([encode_header(TAG, [4], seq=0), b"abcd"])
    got = torch.zeros(4, dtype=torch.uint8)
    under_test.recv(1, TAG, [got], deadline=time.monotonic() + 5)
    assert bytes(got.tolist()) == b"abcd"
    raw.send_multipart([b"EVIL" + GOOD_HEADER[4:], b"abcd"])
    assert len(_wait_for_refusals(under_test, 1)) == 1
    # The peer comes back as a new incarnation: its streams start afresh and are served again.
    reborn = _raw_peer(ctx, under_test, incarnation="reborn")
    reborn.send_multipart([encode_header(TAG, [4], seq=0), b"wxyz"])
    under_test.recv(1, TAG, [got], deadline=time.monotonic() + 5)
    assert bytes(got.tolist()) == b"wxyz"
    _still_serves(under_test, good)


def test_oversized_part_allocates_nothing_and_fails_the_peer(group, monkeypatch):
    (under_test, good), ctx = group
    sizes = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        sizes.append(args[0] if args else kwargs.get("size"))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    raw = _raw_peer(ctx, under_test)
    pending = under_test.irecv(1, TAG, [real_empty(4 * MAX_FRAME, dtype=torch.uint8)], deadline=time.monotonic() + 20)
    # A header within bounds, then a payload part above max_frame_bytes: libzmq drops the connection when the
    # part's length arrives, before reading or allocating it; the peer is then lost like one that died.
    raw.send_multipart([encode_header(TAG, [4 * MAX_FRAME]), bytes(2 * MAX_FRAME)])
    start = time.monotonic()
    with pytest.raises(PeerFailure, match="without a goodbye"):
        pending.wait()
    assert time.monotonic() - start < 5
    assert not any(isinstance(s, int) and s > MAX_FRAME for s in sizes), sizes
    _still_serves(under_test, good)
