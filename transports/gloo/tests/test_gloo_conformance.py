"""The Gloo transport passes the transport conformance suite of openprime.core.testing."""

import functools

from openprime.core.testing import TransportConformance
from openprime.transports.gloo import GlooTransportConfig, create_gloo_transport


class TestGlooTransport(TransportConformance):
    factory = functools.partial(create_gloo_transport, config=GlooTransportConfig(connect_timeout_s=30))
    connects_in_background = True
