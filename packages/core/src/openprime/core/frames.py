"""Wire frames: how messages travel between two peers, on every transport.

A frame is a fixed 8-byte prefix, a msgpack header, then raw payload bytes:

    prefix  = MAGIC (4 bytes) | VERSION (1) | KIND (1) | header length (2, big-endian)
    header  = msgpack map
    payload = raw bytes (data frames only)

A DATA frame carries bytes [off, off + len) of one message: the concatenation of the message's
buffers, whose byte sizes are `sizes`. Its header is {"tag", "seq", "sizes", "off", "len"}: `seq`
numbers the messages one sender sends one receiver under one tag (0, 1, 2, ...), so a message cut
into chunks and striped over several connections is put back together in order on the other side.
Gloo sends one frame per message; the stream transports send one per chunk.

A CONTROL frame carries only a msgpack map (connection handshakes, authentication).

Nothing is pickled. A receiver validates the prefix and header before it reads a payload, and never
allocates a size the peer chose beyond `max_frame_bytes` (DESIGN.md, "Contracts"; PRIME sent pickles).
"""

from __future__ import annotations

import struct
from typing import Any

import attrs
import msgpack

from openprime.core.errors import FrameError

MAGIC = b"OPRM"
VERSION = 1
KIND_DATA = 0
KIND_CONTROL = 1
PREFIX = struct.Struct("!4sBBH")
PREFIX_BYTES = PREFIX.size  # 8
MAX_BUFFERS = 1024
MAX_TAG = (1 << 16) - 1  # tags name collectives and protocols; anything above is a peer's mistake
_DATA_KEYS = {"tag", "seq", "sizes", "off", "len"}


@attrs.frozen
class FrameHeader:
    """The decoded header of one data frame."""

    tag: int
    seq: int
    sizes: tuple[int, ...]
    offset: int
    length: int

    @property
    def message_bytes(self) -> int:
        return sum(self.sizes)


def _prefix(kind: int, body: bytes) -> bytes:
    if len(body) > 0xFFFF:
        raise ValueError(f"frame header of {len(body)} bytes does not fit the 16-bit length field")
    return PREFIX.pack(MAGIC, VERSION, kind, len(body)) + body


def encode_header(tag: int, sizes: list[int] | tuple[int, ...], *, seq: int = 0, offset: int = 0,
                  length: int | None = None) -> bytes:
    """Prefix plus header of a data frame; by default the frame carries the whole message."""
    if len(sizes) > MAX_BUFFERS:
        raise ValueError(f"a message holds at most {MAX_BUFFERS} buffers, got {len(sizes)}")
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag {tag} is outside [0, {MAX_TAG}]")
    sizes = [int(s) for s in sizes]
    length = sum(sizes) - offset if length is None else length
    body = msgpack.packb({"tag": int(tag), "seq": int(seq), "sizes": sizes, "off": int(offset), "len": int(length)})
    return _prefix(KIND_DATA, body)


def encode_control(message: dict[str, Any]) -> bytes:
    """Prefix plus header of a control frame (a msgpack map of plain values)."""
    return _prefix(KIND_CONTROL, msgpack.packb(message))


def decode_prefix(prefix: bytes | memoryview, peer: int | str) -> tuple[int, int]:
    """Validate the 8-byte prefix; return (kind, header length)."""
    if len(prefix) != PREFIX_BYTES:
        raise FrameError(peer, f"truncated prefix ({len(prefix)} of {PREFIX_BYTES} bytes)")
    magic, version, kind, header_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(peer, f"wrong magic {bytes(magic)!r} (expected {MAGIC!r}); not an openprime peer?")
    if version != VERSION:
        raise FrameError(peer, f"unsupported frame version {version} (this side speaks {VERSION})")
    if kind not in (KIND_DATA, KIND_CONTROL):
        raise FrameError(peer, f"unknown frame kind {kind}")
    return kind, header_len


def _unpack_map(body: bytes | memoryview, peer: int | str) -> dict:
    try:
        obj = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise FrameError(peer, f"header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise FrameError(peer, f"header must be a msgpack map, got {type(obj).__name__}")
    return obj


def decode_control(body: bytes | memoryview, peer: int | str) -> dict:
    """Parse a control frame's header."""
    return _unpack_map(body, peer)


def decode_header(body: bytes | memoryview, peer: int | str, *, max_frame_bytes: int) -> FrameHeader:
    """Parse and validate a data frame's header; messages above `max_frame_bytes` are refused."""
    obj = _unpack_map(body, peer)
    if set(obj) != _DATA_KEYS:
        raise FrameError(peer, f"data header must have keys {sorted(_DATA_KEYS)}, got {sorted(map(str, obj))}")
    tag, seq, sizes, off, length = obj["tag"], obj["seq"], obj["sizes"], obj["off"], obj["len"]
    if not all(isinstance(v, int) and v >= 0 for v in (tag, seq, off, length)):
        raise FrameError(peer, "tag, seq, off and len must be non-negative ints")
    if tag > MAX_TAG:
        raise FrameError(peer, f"unknown tag {tag} (tags are at most {MAX_TAG})")
    if not isinstance(sizes, list) or len(sizes) > MAX_BUFFERS:
        raise FrameError(peer, f"sizes must be a list of at most {MAX_BUFFERS} buffer sizes")
    if not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise FrameError(peer, f"buffer sizes must be non-negative ints, got {sizes!r:.200}")
    header = FrameHeader(tag=tag, seq=seq, sizes=tuple(sizes), offset=off, length=length)
    if header.message_bytes > max_frame_bytes:
        raise FrameError(peer, f"message of {header.message_bytes} bytes exceeds max_frame_bytes={max_frame_bytes}")
    if off + length > header.message_bytes:
        raise FrameError(peer, f"chunk [{off}, {off + length}) lies outside a message of {header.message_bytes} bytes")
    return header


def decode_frame_header(frame: bytes | memoryview, peer: int | str, *, max_frame_bytes: int) -> FrameHeader:
    """Decode prefix plus data header from one contiguous buffer (padding after the header is ignored)."""
    kind, header_len = decode_prefix(frame[:PREFIX_BYTES], peer)
    if kind != KIND_DATA:
        raise FrameError(peer, f"expected a data frame, got kind {kind}")
    if PREFIX_BYTES + header_len > len(frame):
        raise FrameError(peer, f"truncated header ({len(frame) - PREFIX_BYTES} of {header_len} bytes)")
    return decode_header(frame[PREFIX_BYTES : PREFIX_BYTES + header_len], peer, max_frame_bytes=max_frame_bytes)
