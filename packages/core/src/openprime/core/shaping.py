"""WAN shaping inside a transport: a rate and a one-way latency per link, on one machine.

INTELLECT-1 ran between continents at about 0.5-4 Gbit/s with 30-300 ms between nodes (paper,
section 3.1, Table 2). To reproduce "4 nodes at 1 Gbit/s and 80 ms apart" on loopback, every chunk a
sender writes to a peer is (1) held until `latency_s` after it was queued, then (2) paced so that the
bytes written to that peer, over all its connections, never run ahead of `rate_bps`:

    a chunk of b bytes occupies the link for b * 8 / rate_bps seconds; the link's clock `busy_until`
    advances by that much, and the writer sleeps until the chunk's slot has passed.

Pacing happens in pieces of at most `PIECE_BYTES`, so a 256 MiB message flows smoothly rather than
in one burst after a long sleep; the measured rate is within a few percent of the target for
messages of 1 MiB and more (tested).
"""

from __future__ import annotations

import threading
import time

from openprime.core.config import config, field, non_negative_float
from openprime.core.errors import ConfigError

PIECE_BYTES = 256 * 1024
CATCH_UP_S = 0.005


@config
class LinkShaping:
    """Simulated WAN link between every pair of peers (0 means unshaped)."""

    rate_bps: float = field(0.0, doc="link rate in bits per second (0: unlimited), e.g. 1e9 for 1 Gbit/s",
                            validator=non_negative_float())
    latency_s: float = field(0.0, doc="one-way latency added to every chunk, e.g. 0.04 for 80 ms round trip",
                             validator=non_negative_float())

    def __attrs_post_init__(self) -> None:
        if 0 < self.rate_bps < 1e5:
            raise ConfigError(f"LinkShaping.rate_bps {self.rate_bps} is below 100 kbit/s; did you mean bits, not "
                              "Mbit? (1 Gbit/s is 1e9)")

    @property
    def active(self) -> bool:
        return self.rate_bps > 0 or self.latency_s > 0


class LinkShaper:
    """The shaped link to one peer, shared by all connections to it (thread-safe)."""

    def __init__(self, shaping: LinkShaping) -> None:
        self._rate_Bps = shaping.rate_bps / 8 if shaping.rate_bps > 0 else 0.0
        self._latency_s = shaping.latency_s
        self._lock = threading.Lock()
        self._busy_until = 0.0

    def hold(self, queued_at: float) -> None:
        """Sleep until the one-way latency has passed since the chunk was queued."""
        if self._latency_s > 0:
            _sleep_until(queued_at + self._latency_s)

    def pace(self, nbytes: int) -> None:
        """Sleep until `nbytes` more may leave without exceeding the link's rate."""
        if self._rate_Bps <= 0 or nbytes <= 0:
            return
        with self._lock:
            # A writer that wakes late must not leave the link idle for the time it overslept: a link that
            # was busy until a moment ago may start this chunk when it would have (up to CATCH_UP_S back).
            now = time.monotonic()
            start = self._busy_until if self._busy_until >= now - CATCH_UP_S else now
            self._busy_until = start + nbytes / self._rate_Bps
            done_at = self._busy_until
        _sleep_until(done_at)


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(left)
