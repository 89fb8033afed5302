"""The TCP transport passes the transport conformance suite of openprime.core.testing."""

import functools

from openprime.core.streams import StreamTransportConfig
from openprime.core.testing import TransportConformance
from openprime.transports.tcp import create_tcp_transport


class TestTcpTransport(TransportConformance):
    factory = functools.partial(create_tcp_transport, config=StreamTransportConfig(connect_timeout_s=30))
