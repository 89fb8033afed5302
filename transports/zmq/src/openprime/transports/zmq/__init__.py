"""openprime.transports.zmq: the Transport interface over ZeroMQ (pyzmq)."""

from openprime.transports.zmq.transport import ZmqTransport, ZmqTransportConfig, create_zmq_transport

__all__ = ["ZmqTransport", "ZmqTransportConfig", "create_zmq_transport"]
