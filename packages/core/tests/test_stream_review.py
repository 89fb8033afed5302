"""Review of the stream transports' shared parts (mailbox, outbox, shaping), driven directly."""

import time

import pytest
import torch

from openprime.core.errors import FrameError
from openprime.core.frames import FrameHeader
from openprime.core.mailbox import Mailbox

PEER, TAG = 1, 5


def _deliver_early(mailbox: Mailbox, sizes: tuple[int, ...], offset: int, length: int, *, seq: int = 0) -> None:
    header = FrameHeader(tag=TAG, seq=seq, sizes=sizes, offset=offset, length=length)
    token, region = mailbox.target(PEER, header, framed=length + 32)
    region.fill_(1)
    mailbox.delivered(PEER, header, token, framed=length + 32)


def test_a_receive_of_another_size_than_a_message_that_arrived_early_in_chunks_fails_with_frame_error():
    """A message that arrived, in several chunks, before its receive was posted with other sizes (a peer on a stale view
    cuts its ring chunks for another world size): irecv raised ValueError from the mailbox's bookkeeping (the first
    chunk failed the receive and dropped the others, the loop went on removing them), not a FrameError at wait()."""
    mailbox = Mailbox(max_unexpected_bytes=1 << 20)
    _deliver_early(mailbox, (64,), 0, 32)
    _deliver_early(mailbox, (64,), 32, 32)
    recv = mailbox.post(PEER, TAG, [torch.empty(48, dtype=torch.uint8)], time.monotonic() + 5)
    with pytest.raises(FrameError, match="buffer sizes"):
        recv.wait()
    assert mailbox._unexpected_bytes == 0 and not mailbox._unexpected
    # The next message under the tag is received as usual.
    _deliver_early(mailbox, (16,), 0, 16, seq=1)
    out = torch.zeros(16, dtype=torch.uint8)
    mailbox.post(PEER, TAG, [out], time.monotonic() + 5).wait()
    assert torch.equal(out, torch.ones(16, dtype=torch.uint8))
