"""Wire frames: how one message travels between two peers.

A frame is a fixed 8-byte prefix, a msgpack header, then the raw bytes of each buffer:

    prefix  = MAGIC (4 bytes) | VERSION (1) | flags (1) | header length (2, big-endian)
    header  = msgpack map {"tag": int, "sizes": [bytes of buffer 0, bytes of buffer 1, ...]}
    payload = buffer 0 bytes | buffer 1 bytes | ...

Nothing is pickled. A receiver validates the prefix and header before it reads a payload, and never
allocates a size the peer chose beyond `max_frame_bytes` (DESIGN.md, "Contracts"; PRIME sent pickles).
"""

from __future__ import annotations

import struct

import attrs
import msgpack

from openprime.core.errors import FrameError

MAGIC = b"OPRM"
VERSION = 1
PREFIX = struct.Struct("!4sBBH")
PREFIX_BYTES = PREFIX.size  # 8
MAX_HEADER_BYTES = 65535  # the prefix's length field is 16 bits
MAX_BUFFERS = 1024


@attrs.frozen
class FrameHeader:
    """The decoded header of one frame."""

    tag: int
    sizes: tuple[int, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(self.sizes)


def encode_header(tag: int, sizes: list[int] | tuple[int, ...]) -> bytes:
    """Prefix plus msgpack header for a message of buffers with byte `sizes` under `tag`."""
    if len(sizes) > MAX_BUFFERS:
        raise ValueError(f"a frame holds at most {MAX_BUFFERS} buffers, got {len(sizes)}")
    body = msgpack.packb({"tag": int(tag), "sizes": [int(s) for s in sizes]})
    return PREFIX.pack(MAGIC, VERSION, 0, len(body)) + body


def decode_prefix(prefix: bytes | memoryview, peer: int | str) -> int:
    """Validate the 8-byte prefix and return the header length that follows it."""
    if len(prefix) != PREFIX_BYTES:
        raise FrameError(peer, f"truncated prefix ({len(prefix)} of {PREFIX_BYTES} bytes)")
    magic, version, _flags, header_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(peer, f"wrong magic {bytes(magic)!r} (expected {MAGIC!r}); not an openprime peer?")
    if version != VERSION:
        raise FrameError(peer, f"unsupported frame version {version} (this side speaks {VERSION})")
    return header_len


def decode_header(body: bytes | memoryview, peer: int | str, *, max_frame_bytes: int) -> FrameHeader:
    """Parse and validate the msgpack header; payloads above `max_frame_bytes` are refused."""
    try:
        obj = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise FrameError(peer, f"header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or set(obj) != {"tag", "sizes"}:
        raise FrameError(peer, f"header must be a map with keys 'tag' and 'sizes', got {obj!r:.200}")
    tag, sizes = obj["tag"], obj["sizes"]
    if not isinstance(tag, int) or not isinstance(sizes, list) or len(sizes) > MAX_BUFFERS:
        raise FrameError(peer, "header fields have the wrong types or too many buffers")
    if not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise FrameError(peer, f"buffer sizes must be non-negative ints, got {sizes!r:.200}")
    header = FrameHeader(tag=tag, sizes=tuple(sizes))
    if header.payload_bytes > max_frame_bytes:
        raise FrameError(
            peer, f"payload of {header.payload_bytes} bytes exceeds max_frame_bytes={max_frame_bytes}"
        )
    return header


def decode_frame_header(frame: bytes | memoryview, peer: int | str, *, max_frame_bytes: int) -> FrameHeader:
    """Decode prefix plus header from one contiguous buffer (padding after the header is ignored)."""
    header_len = decode_prefix(frame[:PREFIX_BYTES], peer)
    if PREFIX_BYTES + header_len > len(frame):
        raise FrameError(peer, f"truncated header ({len(frame) - PREFIX_BYTES} of {header_len} bytes)")
    return decode_header(frame[PREFIX_BYTES : PREFIX_BYTES + header_len], peer, max_frame_bytes=max_frame_bytes)
