"""Every timeout of a run, declared once (house rule 9).

Waits anywhere in openprime are bounded by a value from `Timeouts` or by one derived from it here,
so that a researcher tuning for a slow WAN changes one number and every dependent wait follows.
"""

from __future__ import annotations

from openprime.core.config import config, field, positive_float


@config
class Timeouts:
    """Deadlines for connecting and for each point-to-point operation."""

    connect_s: float = field(60.0, doc="rendezvous and connection set-up, per group", validator=positive_float())
    op_s: float = field(
        120.0,
        doc="one send or receive of one message; at 1 Gbit/s this covers about 15 GB",
        validator=positive_float(),
    )

    def collective_s(self, world_size: int) -> float:
        """Deadline of a ring collective: 2(n-1) sequential steps, each one operation."""
        return self.transfer_s(2 * (world_size - 1))

    def transfer_s(self, num_messages: int) -> float:
        """Deadline of `num_messages` messages sent one after another (a live-recovery state transfer: its chunks),
        each one operation. A 10B model's state is about 20 GB a rank: 300 chunks of 64 MiB, 10 hours at the
        default op_s; a transfer that moves is never cut short by it, one that stalls fails within a few op_s."""
        return self.op_s * max(1, num_messages)
