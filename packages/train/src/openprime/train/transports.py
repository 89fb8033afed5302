"""Choosing the transport and the codec of a run by name, with the pip command when one is not installed."""

from __future__ import annotations

import functools
import importlib
import importlib.util

import attrs

from openprime.core.codec import Codec, Float32Codec
from openprime.core.errors import ConfigError
from openprime.core.timeouts import Timeouts
from openprime.core.transport import TransportFactory
from openprime.diloco import Compression
from openprime.train.config import TransportConfig, TransportKind

# kind -> (module, distribution, folder in the repository)
_INSTALLED_AS = {
    TransportKind.GLOO: ("openprime.transports.gloo", "openprime-transport-gloo", "transports/gloo"),
    TransportKind.TCP: ("openprime.transports.tcp", "openprime-transport-tcp", "transports/tcp"),
    TransportKind.ZMQ: ("openprime.transports.zmq", "openprime-transport-zmq", "transports/zmq"),
}


def transport_factory(cfg: TransportConfig, timeouts: Timeouts) -> TransportFactory:
    """The picklable factory of the configured transport, its deadlines derived from `timeouts`."""
    check_installed(cfg)
    module = importlib.import_module(_INSTALLED_AS[cfg.kind][0])
    if cfg.kind is TransportKind.GLOO:
        options = module.GlooTransportConfig(hostname=cfg.options.hostname, connect_timeout_s=timeouts.connect_s)
        return functools.partial(module.create_gloo_transport, config=options)
    options = attrs.evolve(cfg.options, connect_timeout_s=timeouts.connect_s)
    create = module.create_tcp_transport if cfg.kind is TransportKind.TCP else module.create_zmq_transport
    return functools.partial(create, config=options)


def check_installed(cfg: TransportConfig) -> None:
    """Fail at config time, before any process starts, when the chosen transport is not installed."""
    module_name, dist_name, folder = _INSTALLED_AS[cfg.kind]
    if importlib.util.find_spec(module_name) is None:
        raise ConfigError(
            f"transport {cfg.kind.value!r} is not installed; install it with: pip install ./{folder} "
            f"(the {dist_name} package)"
        )


def codec_for(compression: Compression) -> Codec:
    """The codec of the pseudo-gradients on the wire; int8 needs the openprime-kernels package."""
    if compression is Compression.NONE:
        return Float32Codec()
    if importlib.util.find_spec("openprime.kernels") is None:
        raise ConfigError("diloco.compression=int8 needs the int8 kernels; install them with: "
                          "pip install ./kernels (the openprime-kernels package)")
    from openprime.kernels import Int8Codec

    return Int8Codec()
