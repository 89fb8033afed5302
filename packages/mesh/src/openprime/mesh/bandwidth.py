"""Measuring the bandwidth between the members of a group, for the ring order (paper, section 2.2).

INTELLECT-1 measured the bandwidth between nodes and ordered its ring so that the slowest link is as
fast as possible. Here the members of a fresh group measure each other through the group's own
transport, between outer steps, while the transport is otherwise idle: in round k = 1 .. n-1 every
rank sends a probe to rank + k and receives one from rank - k, so every ordered pair is measured once
and no rank sends or receives two probes at a time. The receiver times from a small start message to
the end of the probe that follows it on the same link, which leaves out how late the sender started.
Results are bytes per second from each sender to this rank; the coordinator keeps them and chooses
the ring with openprime.mesh.ring_order.
"""

from __future__ import annotations

import time

import attrs
import torch

from openprime.core.transport import Transport

TAG_PROBE = 5


@attrs.define
class ProbeBytes:
    """What a probe moved, round by round (a probe that fails keeps the rounds it finished)."""

    sent: int = 0
    received: int = 0


def probe_bandwidth(transport: Transport, nbytes: int, *, deadline: float,
                    moved: ProbeBytes | None = None) -> dict[int, float]:
    """Bytes per second from every other rank to this one (raises PeerFailure like any transfer). `moved` adds up
    the payload bytes this rank sent and received: the probe's traffic, which the outer-step records count."""
    moved = moved if moved is not None else ProbeBytes()
    n, r = transport.world_size, transport.rank
    start_out, start_in = torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    probe_out, probe_in = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    rates = {}
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        got_start = transport.irecv(frm, TAG_PROBE, [start_in], deadline=deadline)
        got_probe = transport.irecv(frm, TAG_PROBE, [probe_in], deadline=deadline)
        sending = [transport.isend(to, TAG_PROBE, [start_out], deadline=deadline),
                   transport.isend(to, TAG_PROBE, [probe_out], deadline=deadline)]
        got_start.wait()
        began = time.monotonic()
        got_probe.wait()
        rates[frm] = nbytes / max(time.monotonic() - began, 1e-6)
        moved.received += 1 + nbytes
        for handle in sending:
            handle.wait()
        moved.sent += 1 + nbytes
    return rates
