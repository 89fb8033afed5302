"""What tests across packages share, in one import: the process harness and the conformance suites.

- `openprime.core.harness`: `run_group` (real processes, one thread each, bounded, none left behind),
  `local_group` (transports between threads), `run_threads`, and `ForwardingTransport` (to inject a fault
  into one call of a working transport).
- `openprime.core.transport_conformance`: `TransportConformance`, the suite every Transport runs, and
  `StreamTransportConformance`, its settings for a transport configured by a StreamTransportConfig.
- `openprime.core.codec_conformance`: `CodecConformance`, the suite every Codec runs.

`run_group`'s fork server preloads this module, and so everything the suites' bodies need.
"""

from openprime.core.codec_conformance import CodecConformance
from openprime.core.harness import (
    KILLED,
    ForwardingTransport,
    GroupContext,
    LocalTransport,
    local_group,
    run_group,
    run_threads,
)
from openprime.core.transport_conformance import (
    DTYPES,
    StreamTransportConformance,
    TransportConformance,
    dtype_message,
    pattern,
    per_rank_factory,
)

__all__ = ["DTYPES", "KILLED", "CodecConformance", "ForwardingTransport", "GroupContext", "LocalTransport",
           "StreamTransportConformance", "TransportConformance",
           "dtype_message", "local_group", "pattern", "per_rank_factory", "run_group", "run_threads"]
