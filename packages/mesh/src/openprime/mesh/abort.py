"""Aborting a doomed try at once, on every process of every node.

A try of an outer step is applied only if every member reported success (coordinator.py). Once a member is
lost (evicted: frozen, or cut off by the network without a connection reset; or gone) or any process of any
member failed its part, the try is doomed; but nothing told the others, who went on waiting for the lost
member until their own deadline: a ring collective's 2(n-1) x timeouts.op_s (28 minutes for 8 nodes at the
default op_s of 120 s), or, in a try that admits new nodes, up to a whole state transfer per joiner (hours for
a 10B model: Recovery.transfer_s). A node cut off by the network leaves its connections open, so no closed
connection cascades round the ring either.

The coordinator's rendezvous store, where every group of the run meets, carries one key per doomed try
(`abort_key`: the try's group name, which names its epoch, step and attempt). It is set by

- the coordinator, when it removes a member of a try still undecided (silent for an eviction timeout, a
  straggler in the commit, a deathrattle), and
- any process whose own part of the try failed (its neighbour died, a state arrived corrupt), just before it
  reports the failure (ElasticDeviceMesh.commit).

Every process watches the key of its current try from a thread (`TryWatch`), reading it every
`mesh.heartbeat_interval_s`, and closes the try's transport when it appears: the waits of the try fail at once
(the transport conformance suite: a close from another thread), the node reports the failure, and the next
try goes on without the lost member. A frozen node thus holds the others one eviction timeout and one poll (8 s
at the defaults), not their deadline. The watch is best effort: a store that cannot be reached (the coordinator
is restarting) only leaves the deadlines to act, as before. A key is only ever set for a try that cannot be
applied, so a try that succeeds is never cut.
"""

from __future__ import annotations

import logging
import socket
import threading

import torch.distributed as dist

from openprime.core.distributed import store_client
from openprime.core.transport import Transport

log = logging.getLogger("openprime.mesh.abort")


def try_group(run_id: str, epoch: int, step: int, attempt: int) -> str:
    """The name every group of one try starts with (each local rank's ring adds `/l{local_rank}`)."""
    return f"{run_id}/e{epoch}/s{step}/a{attempt}"


def abort_key(group: str) -> str:
    """The store key that says the try of `try_group` is doomed; its value says why."""
    return f"{group}/abort"


class TryWatch:
    """One process's watch on the abort key of its current try, from a daemon thread started at the first `watch`."""

    def __init__(self, *, poll_s: float, connect_timeout_s: float, who: str) -> None:
        self.poll_s, self.connect_timeout_s, self.who = poll_s, connect_timeout_s, who
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._target: tuple[str, str, Transport] | None = None  # (store address, key, transport) watched now
        self._to_set: list[tuple[str, str, str]] = []  # (store address, key, reason) to set from the thread
        self._client: tuple[str, dist.TCPStore] | None = None
        self._thread: threading.Thread | None = None
        self.num_aborted = 0  # tries this process aborted on a key it found (for tests and logs)

    def watch(self, store: str, group: str, transport: Transport) -> None:
        """From now on, close `transport` if the try of `group` is doomed (replaces what was watched)."""
        with self._lock:
            self._target = (store, abort_key(group), transport)
            self._start_locked()

    def unwatch(self) -> None:
        """The try is over (committed): nothing to close any more."""
        with self._lock:
            self._target = None

    def doom(self, store: str, group: str, reason: str) -> None:
        """Tell every process of the try of `group` that it is doomed (set in the background: never blocks)."""
        with self._lock:
            self._to_set.append((store, abort_key(group), reason))
            self._start_locked()
        self._wake.set()

    def _start_locked(self) -> None:
        """Start the thread if it is not running yet (called holding the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="openprime-try-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._stop, self._target = True, None
        self._wake.set()
        if self._thread is not None:
            # The thread may be inside one store operation, bounded by connect_timeout_s; a daemon thread still
            # inside TCPStore's C++ code when the interpreter exits aborts the process.
            self._thread.join(timeout=self.connect_timeout_s + 2 * self.poll_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                to_set, self._to_set = self._to_set, []
                target = self._target
            try:
                for store, key, reason in to_set:
                    self._store(store).set(key, reason)
                if target is not None:
                    self._check(target)
            except (RuntimeError, OSError, ValueError) as e:  # the store is gone or restarting: deadlines still act
                log.debug("%s: the abort watch could not reach the rendezvous store: %s", self.who, e)
                self._client = None
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _check(self, target: tuple[str, str, Transport]) -> None:
        store, key, transport = target
        client = self._store(store)
        if not client.check([key]):
            return
        reason = client.get(key).decode(errors="replace")
        with self._lock:
            if self._target is not target:
                return  # the try ended while the key was read
            self._target = None
        log.warning("%s: this try is doomed (%s); aborting it now rather than waiting out its deadlines",
                    self.who, reason)
        self.num_aborted += 1
        transport.close()

    def _store(self, address: str) -> dist.TCPStore:
        if self._client is None or self._client[0] != address:
            # A plain connection first: TCPStore's own retries against a store that is down (a coordinator
            # restarting) last longer than its timeout and print a C++ trace each time.
            host, port = address.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=min(self.poll_s, self.connect_timeout_s)).close()
            self._client = (address, store_client(host, int(port), timeout_s=self.connect_timeout_s))
        return self._client[1]
