"""Bad input from a raw socket: each malformed frame is refused, logged with the peer, and the connection
closed, while the transport goes on serving its other peers. Nothing is allocated at a size the peer chose
beyond max_frame_bytes."""

import socket
import time

import msgpack
import pytest
import torch

from openprime.core import auth
from openprime.core.distributed import host_store
from openprime.core.frames import MAGIC, PREFIX, PREFIX_BYTES, VERSION, decode_control, encode_control, encode_header
from openprime.core.streams import StreamTransportConfig
from openprime.core.testing import run_threads
from openprime.core.transport import Rendezvous
from openprime.transports.tcp import TcpTransport

MAX_FRAME = 1 << 20
CONFIG = StreamTransportConfig(connect_timeout_s=1.5, max_frame_bytes=MAX_FRAME, num_connections=1)


def _raw_header(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return PREFIX.pack(MAGIC, VERSION, 0, len(body)) + body


BAD_FRAMES = {
    "wrong magic": (b"EVIL" + encode_header(1, [4])[4:] + b"abcd", "wrong magic"),
    "wrong version": (PREFIX.pack(MAGIC, VERSION + 7, 0, 0), "unsupported frame version"),
    "oversized": (encode_header(1, [MAX_FRAME + 1]), f"exceeds max_frame_bytes={MAX_FRAME}"),
    "garbage msgpack": (PREFIX.pack(MAGIC, VERSION, 0, 4) + b"\xc1\xc1\xc1\xc1", "not valid msgpack"),
    "unknown tag": (_raw_header({"tag": 1 << 20, "seq": 0, "sizes": [1], "off": 0, "len": 1}) + b"x", "unknown tag"),
    "not a data header": (_raw_header({"hello": "world"}), "data header must have keys"),
}


@pytest.fixture
def group():
    """Rank 0 under test, rank 2 a well-behaved peer (threads of this process); rank 1 is the raw socket."""
    store = host_store(timeout_s=10)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group="bad-frames")
    built = run_threads([lambda: TcpTransport(rendezvous, 0, 3, CONFIG),
                         lambda: TcpTransport(rendezvous, 2, 3, CONFIG)])
    yield built
    for t in built:
        t.close()


def _listening_address(transport: TcpTransport) -> tuple[str, int]:
    host, port = transport._listener.getsockname()[:2]
    return host, port


def _raw_peer(transport: TcpTransport, *, handshake: bool = True) -> socket.socket:
    sock = socket.create_connection(_listening_address(transport), timeout=5)
    if handshake:
        sock.sendall(encode_control(auth.hello(CONFIG.auth, rank=1, to=0, conn=0, incarnation="raw", generation=1,
                                               nonce=auth.new_nonce())))
        kind_len = sock.recv(PREFIX_BYTES, socket.MSG_WAITALL)
        body = sock.recv(PREFIX.unpack(kind_len)[3], socket.MSG_WAITALL)
        assert decode_control(body, "server") == {"op": "ok"}
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _wait_for_refusal(transport: TcpTransport, count: int) -> list[tuple[str, str]]:
    deadline = time.monotonic() + 5
    while len(transport.refusals) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return transport.refusals


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frame_is_refused_and_others_are_served(group, case):
    under_test, good = group
    frame, reason = BAD_FRAMES[case]
    raw = _raw_peer(under_test)
    raw.sendall(frame)
    assert _closed_by_server(raw), "the transport must close a connection that sent a bad frame"
    (addr, why), = _wait_for_refusal(under_test, 1)
    assert reason in why and "rank 1" in why, why
    assert addr.startswith("127.0.0.1:")

    # The transport still serves its other peers.
    deadline = time.monotonic() + 10
    got = torch.zeros(3)
    run_threads([lambda: good.send(0, 5, [torch.tensor([1.0, 2.0, 3.0])], deadline=deadline),
                 lambda: under_test.recv(2, 5, [got], deadline=deadline)])
    assert got.tolist() == [1.0, 2.0, 3.0]


def test_truncated_frame_closes_the_connection(group):
    under_test, _ = group
    raw = _raw_peer(under_test)
    raw.sendall(encode_header(1, [64])[:-3])  # the header is cut short, then the peer goes away
    raw.close()
    deadline = time.monotonic() + 5
    with pytest.raises(Exception, match="peer"):
        under_test.recv(1, 1, [torch.zeros(64, dtype=torch.uint8)], deadline=deadline)


def test_data_without_handshake_is_refused(group):
    under_test, _ = group
    raw = _raw_peer(under_test, handshake=False)
    raw.sendall(encode_header(1, [4]) + b"abcd")
    assert _closed_by_server(raw)
    (_, why), = _wait_for_refusal(under_test, 1)
    assert "expected a handshake frame" in why


def test_oversized_frame_allocates_nothing(group, monkeypatch):
    under_test, _ = group
    sizes = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        sizes.append(args[0] if args else kwargs.get("size"))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    raw = _raw_peer(under_test)
    raw.sendall(encode_header(1, [1 << 40]))  # claims a terabyte
    assert _closed_by_server(raw)
    assert not any(isinstance(s, int) and s > MAX_FRAME for s in sizes), sizes


