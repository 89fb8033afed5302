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

Two exceptions, both about live recovery. At the barrier right after a view that admitted nodes, the donor and
the joiners of that view are timed by the transfer, not by the others' compute: in non-blocking recovery the
donor sends the state after the commit and comes only once it has sent it to every joiner, and a joiner sits the
step out and comes as soon as it has the state (or the transfer broke); a transfer may take longer than an outer
step (INTELLECT-1's: 30-60 minutes). So the clock starts with the first member that trained; the donor's only
once every joiner has come or gone, the joiners' only once the donor has come or gone, and until then only the
bound applies to them. Until 2026-12-05 the donor was waited for up to the bound whatever its joiners did, and a
joiner whose transfer outlasted the deadline was evicted: chaos.py (seed 19) hung local rank 1 of a donor just
after a 0.1 s transfer, and the run stood still until the harness let it go 30 s later (by default it would have
been two hours). In a try that admitted nodes, the donor and the new nodes are timed among themselves (in
blocking recovery they report on the all-reduce only once the transfer is over, which may take longer than an
outer step). A restarted coordinator learns that view, and whether it was applied, from the first member that
reports (`new` and `applied` in its belief); until 2026-12-05 it timed the donor and the joiners like any member.

Where nothing is computed, a deadline of the compute time would only wait longer for a process that is stuck:
the barrier of a retry (its members come straight back from an all-reduce that failed) and the last member not to
report on an all-reduce once every other member has (a collective ends for all within about one ring step) wait
`min_straggler_s`. Until 2026-12-05 both waited an outer step's compute (38 minutes in INTELLECT-1): chaos.py
(seeds 22 and 24) hung a node's local rank 1 just as the node entered a view; the others' groups failed without it
after `timeouts.connect_s`, and with the defaults they would then have waited that long again for it.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping

from openprime.mesh.config import MeshConfig

NUM_COMPUTE_SAMPLES = 3  # outer steps whose longest compute time sets the deadline (one fast one does not)


def is_retry(arrived: Mapping[str, Mapping]) -> bool:
    """The barrier now forming (member -> its sync message) is a retry of an outer step whose try failed: its
    members come straight back from the all-reduce, with no inner steps to compute, so one that does not come is
    not slower, it is stuck."""
    return any(message.get("attempt", 0) > 0 for message in arrived.values())


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
        # At the barrier: when the transfer was over for the donor (every one of _fresh came or left) and for the
        # joiners (the donor left; if it came, its arrival).
        self._donor_freed: float | None = None
        self._joiners_freed: float | None = None

    def deadline_s(self, member: str | None = None, *, computed: bool = True) -> float:
        """How long after the first member the barrier waits for `member`: the sync-timeout bound for the donor of
        the view that admitted nodes just before while it may still be sending them the state, else
        MeshConfig.straggler_deadline_s of the compute time, or, where nothing was `computed` since the others came
        (the barrier of a retry; the end of an all-reduce), of none: `min_straggler_s`."""
        if self._donor is not None and member == self._donor and self._donor_freed is None:
            return self.config.straggler_deadline_s(None)  # sending
        if not computed:
            return self.config.straggler_deadline_s(0.0)
        return self.config.straggler_deadline_s(max(self._compute_s) if self._compute_s else None)

    def known_compute(self) -> str:
        return f"{max(self._compute_s):.0f}s" if self._compute_s else "not known yet"

    # ------------------------------------------------------------------ what the coordinator tells it

    def view_formed(self, members: Collection[str], new: Collection[str], donor: str | None = None) -> None:
        """A view went out: `new` nodes take the state from `donor` (None: the first member not new, as views said
        before they named the donor)."""
        self.barrier_reset()
        self._view_new = frozenset(new)
        if donor not in members or donor in self._view_new:
            donor = next((m for m in members if m not in self._view_new), None)
        self._view_donor = donor if new else None
        self._fresh, self._donor = frozenset(), None

    def barrier_reset(self) -> None:
        self._opened = self._trained_arrived = self._donor_freed = self._joiners_freed = None

    def applied(self, now: float) -> None:
        self._applied_at, self._fresh, self._donor = now, self._view_new, self._view_donor
        self._donor_freed = self._joiners_freed = None

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
        retry = is_retry(arrived)
        late = []
        for m in members:
            if m in arrived:
                continue
            deadline_s = self.config.straggler_timeout_s
            missed = now - self._opened > deadline_s
            since = self._clock_start(m, now, members, arrived)
            if not missed and since is not None:
                deadline_s = self.deadline_s(m, computed=not retry)
                missed = now - since > deadline_s
            if missed:
                late.append((m, deadline_s))
        return late

    def _clock_start(self, m: str, now: float, members: Collection[str],
                     arrived: Mapping[str, Mapping]) -> float | None:
        """When `m`'s deadline starts: the first member that trained came (None: none yet), and for the donor and the
        joiners of the view before, not before their transfer is over (None while it may still be going)."""
        since = self._trained_arrived
        if since is None or self._donor is None or (m != self._donor and m not in self._fresh):
            return since
        if m == self._donor:
            if self._donor_freed is None:
                if any(j in members and j not in arrived for j in self._fresh):
                    return None  # still sending to a joiner
                came = [arrived[j].get("arrived_at", now) for j in self._fresh if j in arrived]
                gone = any(j not in arrived for j in self._fresh)  # left or evicted: noticed now
                self._donor_freed = now if gone or not came else max(came)
            return max(since, self._donor_freed)
        if self._donor in arrived:  # it comes once it has sent the state to every joiner
            return max(since, arrived[self._donor].get("arrived_at", now))
        if self._donor in members:
            return None  # the transfer may still be going
        if self._joiners_freed is None:
            self._joiners_freed = now  # the donor left or was evicted: noticed now
        return max(since, self._joiners_freed)

    def late_in_commit(self, now: float, members: Collection[str], reported_at: Mapping[str, float],
                       alive: Collection[str]) -> list[tuple[str, float]]:
        """The live `members` that have not reported on the all-reduce (`reported_at`: member -> when) and are late,
        with the seconds since the first report: `deadline_s()` after it, the donor and new nodes of a try that
        admitted nodes after another of them reported (or once all of those others are gone), and anyone at the
        latest the bound after it. The last member not to report (any member: once all the others have, the state
        transfers are over too) is late `deadline_s` of no compute (`min_straggler_s`) after the others' last report:
        an all-reduce is a collective of all of them, with nothing to compute, so it ends for every member within
        about one ring step of the others. (Before 2026-12-05 it waited an outer step's compute, 38 minutes in
        INTELLECT-1, for a process hung after the barrier.)"""
        if not reported_at:
            return []
        party = set(self._view_new) | ({self._view_donor} if self._view_donor else set())
        first = min(reported_at.values())
        computed_s, idle_s = self.deadline_s(), self.deadline_s(computed=False)
        late = []
        for m in members:
            if m not in alive or m in reported_at:
                continue
            rest = [o for o in members if o != m and o in alive]
            since: float | None = first
            deadline_s = computed_s
            if rest and all(o in reported_at for o in rest):  # the last one: its all-reduce and transfers are over
                since, deadline_s = max(reported_at[o] for o in rest), idle_s
            elif m in party:
                others = party - {m}
                reported = [reported_at[o] for o in others if o in reported_at]
                since = min(reported) if reported else None if any(o in alive for o in others) else first
            if now - first > self.config.straggler_timeout_s or (since is not None and now - since > deadline_s):
                late.append((m, now - first))
        return late
