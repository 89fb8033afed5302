"""What both ends of a ZeroMQ connection agree on: socket options, endpoints and control messages.

Every openprime frame (openprime.core.frames) travels as one ZeroMQ message: a control frame is one
part (prefix + msgpack map); a data frame is two parts, the prefix + header and then the payload, so
the payload can be sent from the caller's tensor without a copy and received without parsing it.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from openprime.core.errors import FrameError
from openprime.core.frames import KIND_CONTROL, PREFIX_BYTES, decode_control, decode_prefix
from openprime.core.streams import KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S  # the TCP transport's too

BYE = {"op": "bye"}
CONTROL_MAX_BYTES = PREFIX_BYTES + 0xFFFF  # a control frame's header length is a 16-bit field


def endpoint(host: str, port: int | None = None) -> str:
    """A tcp:// endpoint; IPv6 literals need brackets."""
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}" if port is None else f"tcp://{host}:{port}"


def configure(sock: zmq.Socket, host: str) -> None:
    """Options every openprime socket has: no lingering, TCP keepalive, IPv6 when the host is IPv6."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_COUNT)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)


def split_frame(head: bytes | memoryview, who: str) -> tuple[int, memoryview]:
    """Validate the first part of a message: (kind, header body) with the body exactly as declared."""
    head = memoryview(head)
    kind, header_len = decode_prefix(head[:PREFIX_BYTES], who)
    got = len(head) - PREFIX_BYTES
    if got < header_len:
        raise FrameError(who, f"truncated header ({got} of {header_len} bytes)")
    if got > header_len:
        raise FrameError(who, f"{got - header_len} stray bytes after a header of {header_len} bytes")
    return kind, head[PREFIX_BYTES:]


def parse_control(parts: Sequence[bytes | memoryview], who: str) -> dict:
    """The map of a one-part control message; anything else is an invalid frame."""
    kind, body = split_frame(parts[0], who)
    if kind != KIND_CONTROL:
        raise FrameError(who, "sent a data frame where a handshake frame was due (data before the handshake)")
    if len(parts) != 1:
        raise FrameError(who, f"a control frame is one message part, got {len(parts)}")
    return decode_control(body, who)
