"""Wire frames: round trip, and every malformed frame refused with the peer named."""

import msgpack
import pytest

from openprime.core.errors import FrameError
from openprime.core.frames import (
    MAGIC,
    PREFIX,
    PREFIX_BYTES,
    VERSION,
    decode_frame_header,
    decode_prefix,
    encode_header,
)


def _raw_header(body: bytes) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, 0, len(body)) + body


def test_round_trip():
    frame = encode_header(42, [0, 5, 1 << 33])
    header = decode_frame_header(frame + b"\0" * 100, "peer-1", max_frame_bytes=1 << 40)
    assert header.tag == 42 and header.sizes == (0, 5, 1 << 33) and header.payload_bytes == (1 << 33) + 5


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"XXXX" + encode_header(1, [3])[4:], "wrong magic"),
        (PREFIX.pack(MAGIC, VERSION + 1, 0, 0), "unsupported frame version"),
        (encode_header(1, [3])[:5], "truncated prefix"),
        (encode_header(1, [3])[:-2], "truncated header"),
        (PREFIX.pack(MAGIC, VERSION, 0, 3) + b"\xc1\xc1\xc1", "not valid msgpack"),
        (_raw_header(msgpack.packb(7)), "must be a map"),
        (_raw_header(msgpack.packb({"tag": 1, "sizes": [-1]})), "non-negative"),
        (_raw_header(msgpack.packb({"tag": 1, "sizes": [1], "extra": 2})), "must be a map"),
        (encode_header(1, [2048]), "exceeds max_frame_bytes=1024"),
    ],
)
def test_malformed_frames_are_refused(frame, message):
    with pytest.raises(FrameError, match=message) as e:
        decode_frame_header(frame, "10.0.0.7:5555", max_frame_bytes=1024)
    assert "10.0.0.7:5555" in str(e.value)


def test_prefix_size():
    assert PREFIX_BYTES == 8
    assert decode_prefix(encode_header(3, [1])[:PREFIX_BYTES], 0) > 0
