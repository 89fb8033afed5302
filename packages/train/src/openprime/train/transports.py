"""Choosing the transport of a run by name, with the pip command when it is not installed."""

from __future__ import annotations

import functools
import importlib

from openprime.core.errors import ConfigError
from openprime.core.timeouts import Timeouts
from openprime.core.transport import TransportFactory
from openprime.train.config import TransportConfig, TransportKind

# kind -> (module, distribution, folder in the repository)
_INSTALLED_AS = {
    TransportKind.GLOO: ("openprime.transports.gloo", "openprime-transport-gloo", "transports/gloo"),
}


def transport_factory(cfg: TransportConfig, timeouts: Timeouts) -> TransportFactory:
    """The picklable factory of the configured transport, its deadlines derived from `timeouts`."""
    module_name, dist_name, folder = _INSTALLED_AS[cfg.kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        raise ConfigError(
            f"transport {cfg.kind.value!r} is not installed; install it with: pip install ./{folder} "
            f"(the {dist_name} package)"
        ) from None
    if cfg.kind is TransportKind.GLOO:
        options = module.GlooTransportConfig(hostname=cfg.hostname, connect_timeout_s=timeouts.connect_s)
        return functools.partial(module.create_gloo_transport, config=options)
    raise AssertionError(f"no factory for {cfg.kind}")
