"""The ZeroMQ transport passes the transport conformance suite of openprime.core.testing."""

from openprime.core.testing import StreamTransportConformance
from openprime.transports.zmq import create_zmq_transport


class TestZmqTransport(StreamTransportConformance):
    create = staticmethod(create_zmq_transport)
