"""Wire frames: round trip, and every malformed frame refused with the peer named."""

import msgpack
import pytest

from openprime.core.errors import FrameError
from openprime.core.frames import (
    KIND_CONTROL,
    MAGIC,
    PREFIX,
    PREFIX_BYTES,
    VERSION,
    decode_control,
    decode_frame_header,
    decode_prefix,
    encode_control,
    encode_header,
)


def _raw_header(body: bytes) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, 0, len(body)) + body


def test_round_trip():
    frame = encode_header(42, [0, 5, 1 << 33])
    header = decode_frame_header(frame + b"\0" * 100, "peer-1", max_frame_bytes=1 << 40)
    assert header.tag == 42 and header.sizes == (0, 5, 1 << 33) and header.message_bytes == (1 << 33) + 5
    assert header.seq == 0 and header.offset == 0 and header.length == header.message_bytes


def test_chunk_round_trip():
    header = decode_frame_header(encode_header(7, [100, 28], seq=3, offset=64, length=32), 0, max_frame_bytes=1024)
    assert (header.tag, header.seq, header.offset, header.length) == (7, 3, 64, 32)


def test_control_round_trip():
    frame = encode_control({"hello": 1, "rank": 3, "nonce": b"\x01\x02"})
    kind, n = decode_prefix(frame[:PREFIX_BYTES], 0)
    assert kind == KIND_CONTROL
    assert decode_control(frame[PREFIX_BYTES:PREFIX_BYTES + n], 0) == {"hello": 1, "rank": 3, "nonce": b"\x01\x02"}


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"XXXX" + encode_header(1, [3])[4:], "wrong magic"),
        (PREFIX.pack(MAGIC, VERSION + 1, 0, 0), "unsupported frame version"),
        (encode_header(1, [3])[:5], "truncated prefix"),
        (encode_header(1, [3])[:-2], "truncated header"),
        (PREFIX.pack(MAGIC, VERSION, 0, 3) + b"\xc1\xc1\xc1", "not valid msgpack"),
        (_raw_header(msgpack.packb(7)), "must be a msgpack map"),
        (_raw_header(msgpack.packb({"tag": 1, "seq": 0, "sizes": [-1], "off": 0, "len": 0})), "non-negative"),
        (_raw_header(msgpack.packb({"tag": 1, "sizes": [1], "extra": 2})), "data header must have keys"),
        (_raw_header(msgpack.packb({"tag": 1 << 20, "seq": 0, "sizes": [1], "off": 0, "len": 1})), "unknown tag"),
        (encode_header(1, [10], offset=8, length=4), "lies outside a message"),
        (PREFIX.pack(MAGIC, VERSION, 9, 0), "unknown frame kind"),
        (encode_header(1, [2048]), "exceeds max_frame_bytes=1024"),
    ],
)
def test_malformed_frames_are_refused(frame, message):
    with pytest.raises(FrameError, match=message) as e:
        decode_frame_header(frame, "10.0.0.7:5555", max_frame_bytes=1024)
    assert "10.0.0.7:5555" in str(e.value)


def test_prefix_size():
    assert PREFIX_BYTES == 8
    assert decode_prefix(encode_header(3, [1])[:PREFIX_BYTES], 0)[1] > 0
