"""torch.distributed plumbing that never touches the default process group.

openprime builds every group on its own store prefix (one per group and epoch), so that groups can be
torn down and rebuilt when membership changes without `init_process_group`'s global state; PRIME's
reliance on the default group is part of why its elastic mode was fragile.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from openprime.core.errors import PeerFailure
from openprime.core.transport import Rendezvous

T = TypeVar("T")


def host_store(host: str = "127.0.0.1", port: int = 0, *, timeout_s: float) -> dist.TCPStore:
    """Start the master of a rendezvous store (port 0 picks a free port; read it from `.port`)."""
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def store_client(host: str, port: int, *, timeout_s: float) -> dist.TCPStore:
    """A client of the rendezvous store at host:port, over the whole of its keys."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


#: How often `peer_address` looks at the store and at its `closed` flag.
ADDRESS_POLL_S = 0.05


def peer_address(store: dist.Store, peer: int, *, deadline: float, closed: threading.Event) -> str:
    """The address `peer` published in the group's store (key `addr/PEER`), once it has.

    Polled rather than a blocking `get`, which holds its caller until the store's timeout (the connect timeout,
    60 s by default): a transport closed meanwhile (a doomed try's abort) would wait that long for the thread
    looking up a peer that never came. Each look is itself bounded (`_bounded`): a store whose process does not
    run (stopped, its machine paused or cut off without a reset) answers neither `check` nor `get`, and torch's
    client then waits past its own timeout, holding the link's lock that the try's sends and its abort need.
    Raises PeerFailure when `closed` is set, or at `deadline`."""
    key = f"addr/{peer}"
    while not _bounded(lambda: store.check([key]), peer, deadline=deadline, closed=closed):
        if closed.is_set():
            raise PeerFailure(peer, "transport is closed")
        if time.monotonic() >= deadline:
            raise PeerFailure(peer, "the peer did not publish its address before the deadline")
        time.sleep(ADDRESS_POLL_S)
    return _bounded(lambda: store.get(key), peer, deadline=deadline, closed=closed).decode()


def _bounded(call: Callable[[], T], peer: int, *, deadline: float, closed: threading.Event) -> T:
    """`call()` (a store request) on a daemon thread, waited for until `deadline` or `closed`: PeerFailure then,
    and the thread is left to end whenever the store answers (or with the process)."""
    outcome: list = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as e:  # handed to the caller
            outcome.append((False, e))
        done.set()

    threading.Thread(target=run, daemon=True, name=f"openprime-store-lookup-{peer}").start()
    while not done.wait(ADDRESS_POLL_S):
        if closed.is_set():
            raise PeerFailure(peer, "transport is closed")
        if time.monotonic() >= deadline:
            raise PeerFailure(peer, "the rendezvous store did not answer before the deadline (its process stopped, "
                                    "or its machine cut off?)")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def connect_store(rendezvous: Rendezvous, timeout_s: float, *, suffix: str = "") -> dist.Store:
    """A client of the rendezvous store, scoped to the group's own key prefix (plus `suffix`). PeerFailure (peer -1,
    the store) if the store does not answer within `timeout_s` and a second: a store whose process does not run
    accepts the connection and never answers its handshake, where torch's client waited past its own timeout."""
    client = _bounded(lambda: store_client(rendezvous.host, rendezvous.port, timeout_s=timeout_s), -1,
                      deadline=time.monotonic() + timeout_s + 1.0, closed=threading.Event())
    return dist.PrefixStore(rendezvous.group + suffix, client)


def gloo_group(store: dist.Store, rank: int, world_size: int, *, timeout_s: float,
               host: str = "127.0.0.1") -> dist.ProcessGroupGloo:
    """A Gloo process group over `store`, independent of the default group.

    `timeout_s` bounds Gloo's own connection set-up and any operation waited on without a timeout.
    """
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
