"""The interface between DiLoCo and whoever decides the group of each outer step.

DiLoCo (openprime.diloco) and the elastic mesh (openprime.mesh) know nothing of each other; both know
this. At every outer step DiLoCo asks its `Membership` to `begin` a try: the answer is the transport of
this try's group, this node's place in it, who is new (they receive the state first) and whether the
step is skipped. After its all-reduce DiLoCo reports success with `commit` and applies the result only
if every member succeeded. `StaticMembership` is a fixed group that never changes (one node, or a
static run over one transport); the mesh provides the elastic one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import attrs

from openprime.core.errors import PeerFailure
from openprime.core.transport import Transport


@attrs.frozen
class Round:
    """One try of one outer step, as every member sees it."""

    transport: Transport
    step: int  # the outer step and try every member is at (a newcomer learns them here)
    attempt: int
    skip: bool = False  # the tries are used up: no member applies anything this outer step
    new_ranks: tuple[int, ...] = ()  # members admitted at this barrier: they receive the state first
    donor_rank: int = 0  # the member that sends them the state
    state_hash: str | None = None  # the hash the members agreed on after the previous outer step, if known
    # Bytes this node's membership moved since the last round outside any outer step (bandwidth probes): real
    # traffic, which the caller counts in this outer step's record.
    side_bytes_sent: int = 0
    side_bytes_received: int = 0


class Membership(ABC):
    """Decides the group of every try of every outer step."""

    @abstractmethod
    def begin(self, step: int, attempt: int, *, state_hash: str | None, hash_step: int) -> Round:
        """Wait for the others at the barrier of (step, attempt); report the state's hash after `hash_step`.

        `hash_step` is -1 for the initial weights; `state_hash` is None while a joiner has no state yet.
        """

    @abstractmethod
    def commit(self, step: int, attempt: int, ok: bool) -> bool:
        """Report this member's all-reduce outcome; True when every member succeeded."""

    @abstractmethod
    def abandon(self) -> None:
        """A collective after the commit (the comparison of the state hashes) failed on the last round's transport:
        close that transport now, so that members still waiting on this node in it fail at once instead of at
        their deadline (they close theirs in turn: the failure goes round the ring in a few round trips). The
        next `begin` may give the closed transport back: a group is rebuilt only when every member does (a new
        view, or a retry), so under an unchanged view the next outer step's first try fails at once and its retry
        gives a working transport."""

    def idle(self) -> None:
        """The caller is done with the last round's transport until its next `begin` (the outer step's counted
        traffic is over): background work of the membership, such as measuring the links, may use it now. A
        membership without such work does nothing here."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Leave the group (the transport of the last round included)."""


class StaticMembership(Membership):
    """A group that never changes: every try uses the same transport and always commits what succeeded."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def begin(self, step: int, attempt: int, *, state_hash: str | None, hash_step: int) -> Round:
        return Round(transport=self.transport, step=step, attempt=attempt)

    def commit(self, step: int, attempt: int, ok: bool) -> bool:
        if not ok:
            raise PeerFailure(tuple(range(self.transport.world_size)),
                              "a peer of a static group failed during the all-reduce; a static group cannot go on "
                              "without it (run under the mesh for elastic membership)")
        return True

    def abandon(self) -> None:
        self.transport.close()  # a peer failed: this group cannot go on (its next commit says so)

    def close(self) -> None:
        self.transport.close()
