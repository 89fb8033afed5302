"""openprime.transports.gloo: the Transport interface over a Gloo process group."""

from openprime.transports.gloo.transport import GlooTransport, GlooTransportConfig, create_gloo_transport

__all__ = ["GlooTransport", "GlooTransportConfig", "create_gloo_transport"]
