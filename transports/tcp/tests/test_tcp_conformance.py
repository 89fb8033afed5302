"""The TCP transport passes the transport conformance suite of openprime.core.testing."""

from openprime.core.testing import StreamTransportConformance
from openprime.transports.tcp import create_tcp_transport


class TestTcpTransport(StreamTransportConformance):
    create = staticmethod(create_tcp_transport)
