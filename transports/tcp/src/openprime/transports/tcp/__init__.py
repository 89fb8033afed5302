"""openprime.transports.tcp: the Transport interface over standard-library TCP sockets."""

from openprime.transports.tcp.transport import TcpTransport, TcpTransportConfig, create_tcp_transport

__all__ = ["TcpTransport", "TcpTransportConfig", "create_tcp_transport"]
