"""The Transport interface: reliable, framed point-to-point messages between the peers of a group.

A group is `world_size` processes with ranks 0..world_size-1 that met at a `Rendezvous`. A message is
a list of contiguous CPU tensors (any dtype) sent to one peer under an integer tag; the receiver
passes preallocated tensors of the same sizes and they are filled in place. Messages between two
peers under one tag arrive in the order they were sent. `irecv_add` receives a message of fp32 values
and adds it into an accumulator (the reduce-scatter of the ring all-reduce); ZeroMQ adds each chunk
as it arrives, from its own message memory, instead of copying it into a buffer first.

Every operation carries an absolute deadline (`time.monotonic()` seconds). A lost peer or a passed
deadline raises `PeerFailure` naming the peer; no call hangs. After a `PeerFailure` the transport may
be unusable and the caller rebuilds the group (the mesh does this at the next view).

Byte counters count framed bytes (prefix + header + payload) actually handed to or taken from the
wire, so benchmarks and the bandwidth claims of DESIGN.md are measured, not assumed.

Implementations: openprime.transports.gloo (and, later, zmq and tcp). Each runs the conformance
suite in `openprime.core.testing`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from openprime.core.config import config, field, instance_of, positive_int
from openprime.core.frames import encode_header


@config
class Rendezvous:
    """Where the peers of one group meet: a TCP key-value store and a key prefix for this group."""

    host: str = field(doc="address of the store (the launcher or coordinator hosts it)", validator=instance_of(str))
    port: int = field(doc="TCP port of the store", validator=positive_int())
    group: str = field(doc="key prefix naming this group and epoch, e.g. 'diloco/0'", validator=instance_of(str))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's memory (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("transport buffers must be contiguous CPU tensors")
    return t.reshape(-1).view(torch.uint8)


def check_add_buffers(acc: torch.Tensor, scratch: torch.Tensor) -> None:
    """Transport.irecv_add's arguments: contiguous fp32 CPU tensors of the same size."""
    if acc.dtype != torch.float32 or scratch.dtype != torch.float32 or scratch.numel() != acc.numel():
        raise ValueError(f"irecv_add adds into fp32 through an fp32 scratch of the same size, got {acc.dtype} "
                         f"{acc.numel()} and {scratch.dtype} {scratch.numel()}")
    as_bytes(acc), as_bytes(scratch)  # contiguous, on the CPU


def remaining(deadline: float) -> float:
    """Seconds left until `deadline` (monotonic), never negative."""
    return max(0.0, deadline - time.monotonic())


class Handle(ABC):
    """An operation in flight."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation completes; raise PeerFailure at its deadline or if the peer is lost."""


class _AddOnWait(Handle):
    """irecv_add's default: the message lands in the scratch buffer, then is added into the accumulator."""

    def __init__(self, receiving: Handle, acc: torch.Tensor, scratch: torch.Tensor) -> None:
        self._receiving, self._acc, self._scratch = receiving, acc, scratch
        self._added = False

    def wait(self) -> None:
        self._receiving.wait()
        if not self._added:
            self._acc.add_(self._scratch.view(self._acc.shape))
            self._added = True


class Transport(ABC):
    """Point-to-point framed messages with deadlines. See the module docstring for the contract."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self._counter_lock = threading.Lock()  # the byte counters and `_unreachable`, updated from I/O threads
        self._bytes_sent = 0
        self._bytes_received = 0
        self._unreachable: frozenset[int] = frozenset()  # replaced, never changed: read without the lock

    @property
    def unreachable(self) -> frozenset[int]:
        """The peers this transport tried to connect to and could not, since (a connection refused, reset or timed
        out; not a peer that closed a connection it had), as a firewall or a broken route between two machines
        leaves them. The membership reports them when a try fails, so that the coordinator can tell a node nobody
        reaches from a try that failed for other reasons (openprime.mesh.links). Transports that connect
        through a library that does not say to whom (Gloo) report none."""
        return self._unreachable

    def _reached(self, peer: int, ok: bool) -> None:
        """A connection attempt to `peer` succeeded (`ok`) or failed: kept for `unreachable`. Connections are made
        from several threads, and the membership reads the set from another one (a set copied while a thread
        adds to it raises)."""
        with self._counter_lock:
            self._unreachable = self._unreachable - {peer} if ok else self._unreachable | {peer}

    @property
    def bytes_sent(self) -> int:
        """Framed bytes handed to the wire so far."""
        return self._bytes_sent

    @property
    def bytes_received(self) -> int:
        """Framed bytes taken from the wire so far."""
        return self._bytes_received

    def _count(self, *, sent: int = 0, received: int = 0) -> None:
        with self._counter_lock:
            self._bytes_sent += sent
            self._bytes_received += received

    @abstractmethod
    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        """Start sending `buffers` to `peer` under `tag`. The buffers must not change until wait()."""

    @abstractmethod
    def irecv(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        """Start receiving a message from `peer` under `tag` into the preallocated `buffers`."""

    def irecv_add(self, peer: int, tag: int, acc: torch.Tensor, *, scratch: torch.Tensor, deadline: float) -> Handle:
        """Start receiving a message of one fp32 buffer the size of the contiguous fp32 `acc`, and add it into `acc`.

        The sender sends an ordinary message. `scratch` (fp32, acc's size) is memory the transport may receive
        into first: this default does, and adds once the message is complete (in wait()); ZeroMQ adds each chunk
        as it arrives from its own message memory, which saves the ring all-reduce's reduce-scatter a copy.
        After a failure `acc` is undefined (partly added).
        """
        check_add_buffers(acc, scratch)
        return _AddOnWait(self.irecv(peer, tag, [scratch], deadline=deadline), acc, scratch)

    def send(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> None:
        """Send and wait."""
        self.isend(peer, tag, buffers, deadline=deadline).wait()

    def recv(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> None:
        """Receive and wait."""
        self.irecv(peer, tag, buffers, deadline=deadline).wait()

    def frame_bytes(self, tag: int, sizes: Sequence[int]) -> int:
        """Bytes this transport puts on the wire for one message with payload buffer `sizes`."""
        return len(encode_header(tag, list(sizes))) + sum(sizes)

    @abstractmethod
    def close(self) -> None:
        """Release connections. Idempotent; operations after close raise PeerFailure."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: invalid peer {peer} in a group of {self.world_size}")


TransportFactory = Callable[[Rendezvous, int, int], Transport]
"""Builds the transport of rank `rank` in a group of `world_size` meeting at a rendezvous.

Factories are picklable (a top-level function, or functools.partial of one with a config) so that
the launcher and the test harness can hand them to child processes.
"""
