"""Stragglers: members alive by their heartbeats that hold the others at the barrier or in the commit.

A node whose heartbeat thread runs while one of its processes hangs (a stuck kernel, a deadlock in its local
group) never comes to the outer-step barrier, or, if it hung after its rank 0 got there, never builds its group
and never reports on the all-reduce. Waiting for it until the members' own `sync_timeout_s` (two hours by
default) costs the whole run that long; INTELLECT-1's outer steps computed for about 38 minutes. The coordinator
keeps this clock: it is told when views form, when outer steps are applied and when members arrive or report,
and says who is late (`MeshConfig.straggler_deadline_s`: about one outer step's compute time).

    compute time = from an applied commit to the first arrival at the next barrier (the fastest member), as the
                   nodes measure it themselves (`compute_s` in their sync and commit messages, so that a restarted
                   coordinator keeps it) or else as this clock saw it; the longest of the last NUM_COMPUTE_SAMPLES
    arrival        = when a member first sent its sync (or its report on the all-reduce): the coordinator's receipt
                   less the `waited_s` the node states, so that a coordinator restarted while the members wait
                   times them from when they came, not from its restart (which chaos.py's restarts, every 11-13 s
                   against a 15 s deadline, put off for 80 s); a coordinator that just (re)started evicts no
                   straggler for its first `recovery_window_s`, while the members resend

Two exceptions, both about live recovery: at the barrier right after a view that admitted nodes, its donor is
waited for up to the bound (in non-blocking recovery it sends the state before it comes) and the clock starts
with the first member that trained, not with the joiner, which sat the step out and comes at once; in a try that
admitted nodes, the donor and the new nodes are timed among themselves (in blocking recovery they report on the
all-reduce only once the transfer is over, which may take longer than an outer step).
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping

from openprime.mesh.config import MeshConfig

NUM_COMPUTE_SAMPLES = 3  # outer steps whose longest compute time sets the deadline (one fast one does not)


class StragglerClock:
    """The coordinator's timings of outer steps and of the barrier now forming."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self._compute_s: collections.deque[float] = collections.deque(maxlen=NUM_COMPUTE_SAMPLES)
        self._applied_at: float | None = None  # when the last outer step was applied, until the next barrier opens
        self._opened: float | None = None  # when the first member reached the barrier now forming
        self._trained_arrived: float | None = None  # ... and the first that trained since the last outer step
        # The new nodes and the donor of the view now in its all-reduce, and, once it is applied, until the next view.
        self._view_new: frozenset[str] = frozenset()
        self._view_donor: str | None = None
        self._fresh: frozenset[str] = frozenset()
        self._donor: str | None = None

    def deadline_s(self, member: str | None = None) -> float:
        """How long after the first member the barrier waits for `member`: the sync-timeout bound for the donor of
        the view that admitted nodes just before, else MeshConfig.straggler_deadline_s of the compute time."""
        known = max(self._compute_s) if self._compute_s and (self._donor is None or member != self._donor) else None
        return self.config.straggler_deadline_s(known)

    def known_compute(self) -> str:
        return f"{max(self._compute_s):.0f}s" if self._compute_s else "not known yet"

    # ------------------------------------------------------------------ what the coordinator tells it

    def view_formed(self, members: Collection[str], new: Collection[str]) -> None:
        self._opened = self._trained_arrived = None
        self._view_new = frozenset(new)
        self._view_donor = next((m for m in members if m not in self._view_new), None) if new else None  # elastic.py
        self._fresh, self._donor = frozenset(), None

    def barrier_reset(self) -> None:
        self._opened = self._trained_arrived = None

    def applied(self, now: float) -> None:
        self._applied_at, self._fresh, self._donor = now, self._view_new, self._view_donor

    def reported(self, compute_s: float | None) -> None:
        """A member reported on its all-reduce, with its own compute time: taken only when nothing is timed (this
        coordinator restarted mid-commit)."""
        if not self._compute_s and compute_s is not None:
            self._compute_s.append(float(compute_s))

    # ------------------------------------------------------------------ who is late

    def late_at_barrier(self, now: float, members: Collection[str], arrived: Mapping[str, Mapping]) -> list[
            tuple[str, float]]:
        """The live `members` not at the barrier (`arrived`: member -> its sync message, with the coordinator's
        `arrived_at`: when the member first sent it, across a coordinator restart) that are late, with the deadline
        each missed: `deadline_s(m)` after the first member that trained arrived, and at the latest the bound after
        the first member at all."""
        if not arrived:
            self.barrier_reset()
            return []

        def first(ms: Collection[str]) -> float:
            return min(arrived[m].get("arrived_at", now) for m in ms)

        self._opened = first(arrived) if self._opened is None else min(self._opened, first(arrived))
        trained = [m for m in arrived if m not in self._fresh]
        if trained and self._trained_arrived is None:
            self._trained_arrived = first(trained)
            # What the nodes measured themselves (the fastest, if several came at once): kept across restarts.
            reported = [arrived[m]["compute_s"] for m in trained if "compute_s" in arrived[m]]
            if reported:
                self._compute_s.append(float(min(reported)))
            elif self._applied_at is not None:
                self._compute_s.append(max(0.0, self._trained_arrived - self._applied_at))
            self._applied_at = None
        elif trained:  # one that came earlier, heard only now (it resent to a restarted coordinator)
            self._trained_arrived = min(self._trained_arrived, first(trained))
        late = []
        for m in members:
            if m in arrived:
                continue
            deadline_s = self.config.straggler_timeout_s
            missed = now - self._opened > deadline_s
            if not missed and self._trained_arrived is not None:
                deadline_s = self.deadline_s(m)
                missed = now - self._trained_arrived > deadline_s
            if missed:
                late.append((m, deadline_s))
        return late

    def late_in_commit(self, now: float, members: Collection[str], reported_at: Mapping[str, float],
                       alive: Collection[str]) -> list[tuple[str, float]]:
        """The live `members` that have not reported on the all-reduce (`reported_at`: member -> when) and are late,
        with the seconds since the first report: `deadline_s()` after it, the donor and new nodes of a try that
        admitted nodes after another of them reported (or once all of those others are gone), and anyone at the
        latest the bound after it."""
        if not reported_at:
            return []
        party = set(self._view_new) | ({self._view_donor} if self._view_donor else set())
        first, deadline_s = min(reported_at.values()), self.deadline_s()
        late = []
        for m in members:
            if m not in alive or m in reported_at:
                continue
            since: float | None = first
            if m in party:
                others = party - {m}
                reported = [reported_at[o] for o in others if o in reported_at]
                since = min(reported) if reported else None if any(o in alive for o in others) else first
            if now - first > self.config.straggler_timeout_s or (since is not None and now - since > deadline_s):
                late.append((m, now - first))
        return late
