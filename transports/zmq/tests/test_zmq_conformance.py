"""The ZeroMQ transport passes the transport conformance suite of openprime.core.testing."""

import functools

import attrs

from openprime.core.streams import StreamTransportConfig
from openprime.core.testing import TransportConformance
from openprime.transports.zmq import create_zmq_transport

BASE = StreamTransportConfig(connect_timeout_s=30)


def _with(**changes) -> functools.partial:
    return functools.partial(create_zmq_transport, config=attrs.evolve(BASE, **changes))


class TestZmqTransport(TransportConformance):
    factory = _with()
    connects_in_background = True
    shaped_factory = staticmethod(lambda shaping: _with(shaping=shaping))
    secured_factory = staticmethod(lambda auth: _with(auth=auth, connect_timeout_s=5))
    addressed_factory = staticmethod(lambda hostname, listen_host: _with(hostname=hostname, listen_host=listen_host))
    supports_restart = True
