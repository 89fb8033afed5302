"""What the stream transports (raw TCP and ZeroMQ) share: their settings.

Both move messages as chunked data frames over `num_connections` connections per peer (outbox.py),
reassemble them into the receiver's buffers (mailbox.py), shape every link (shaping.py) and
authenticate every connection (auth.py). Their config is therefore one class.
"""

from __future__ import annotations

import socket

import attrs

from openprime.core.auth import AuthConfig
from openprime.core.config import all_of, config, field, instance_of, multiple_of, positive_float, positive_int
from openprime.core.shaping import PIECE_BYTES, LinkShaping

# Keepalive probes find a peer whose machine vanished (no FIN, no RST) and keep NAT mappings open on long WAN links
# that idle between outer steps (INTELLECT-1, section 3.1: about 38 min of compute; an AWS NAT gateway drops an idle
# mapping after 350 s). A dead peer is found within KEEPALIVE_IDLE_S + KEEPALIVE_COUNT x KEEPALIVE_INTERVAL_S.
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_COUNT = 6


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keepalive with the probes above (a plain socket; ZeroMQ sets the same through its options)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


@config
class StreamTransportConfig:
    """Settings of a stream transport (TCP or ZeroMQ)."""

    hostname: str = field("127.0.0.1", doc="address peers connect to (advertised); also listened on unless listen_host",
                          validator=instance_of(str))
    listen_host: str | None = field(None, doc="address to listen on, when not hostname: 0.0.0.0 behind NAT, where "
                                              "hostname is a public address no interface of this machine has",
                                    validator=attrs.validators.optional(instance_of(str)))
    num_connections: int = field(4, doc="parallel connections per peer; large messages are striped over them",
                                 validator=positive_int())
    # A multiple of 8: chunks of an fp32 (or fp64) message then hold whole numbers, which ZeroMQ adds into the
    # receiver's accumulator as they come; any other size failed every uncompressed all-reduce over ZeroMQ.
    chunk_bytes: int = field(4 << 20, doc="largest piece of a message sent as one frame (a multiple of 8)",
                             validator=all_of(positive_int(), multiple_of(8)))
    max_frame_bytes: int = field(1 << 34, doc="largest message accepted from a peer (bytes)", validator=positive_int())
    max_unexpected_bytes: int = field(1 << 30, doc="bytes held for receives not yet posted, per transport",
                                      validator=positive_int())
    connect_timeout_s: float = field(60.0, doc="bound on finding, connecting to and authenticating a peer",
                                     validator=positive_float())
    shaping: LinkShaping = field(factory=LinkShaping, doc="simulated WAN rate and latency per link",
                                 validator=instance_of(LinkShaping))
    auth: AuthConfig = field(factory=AuthConfig, doc="run id and shared secret checked on every connection",
                             validator=instance_of(AuthConfig))

    @property
    def bind_host(self) -> str:
        """The address the transport listens on."""
        return self.hostname if self.listen_host is None else self.listen_host

    def cannot_listen(self, error: object) -> str:
        """The message for a listening socket that could not be bound: what was asked, why, and the way out."""
        asked = (f"transport.options.listen_host={self.listen_host!r}" if self.listen_host is not None
                 else f"transport.options.hostname={self.hostname!r}")
        return (f"cannot listen on {self.bind_host!r} ({asked}): {error}. hostname is the address the other machines "
                f"connect to; when no interface of this machine has it (a cloud VM's public address is usually NAT'ed "
                f"to a private one), also set transport.options.listen_host=0.0.0.0 (all of this machine's addresses)")

    @property
    def effective_chunk_bytes(self) -> int:
        """Shaped links pace in small pieces so that a large message flows at the link's rate."""
        return min(self.chunk_bytes, PIECE_BYTES) if self.shaping.active else self.chunk_bytes
