"""The commit of each all-reduce: apply it only where every member of its view got it.

After its all-reduce every member reports to the coordinator whether its part worked, and waits for the decision.
The decision is "apply" only if every member of the view reported success; otherwise every survivor retries the
outer step (the coordinator's next barrier), so that no node ever applies a result another node did not get (the
replicas would drift apart for the rest of the run, PRIME's failure mode: it had no commit).

A try that can no longer be applied (a member was removed, or one reported that its part failed) is marked doomed
in the rendezvous store at once (abort.py): every process of every member stops waiting on it within a heartbeat,
instead of at its collective deadline, 2(n-1) x op_s.

A coordinator restarted between the view and the reports re-forms the committee from the reports themselves
(their step and attempt; the members of the view it adopted from the nodes). One restarted after it decided but
before every member heard the decision takes it from the messages of a member that heard it (`heard`): that one
applied the try and says so in its belief, or comes to the barrier of the retry, and never reports again.

This module keeps the committee and the decisions; the coordinator owns membership (who is removed, and when a
silent member is evicted: `StragglerClock.late_in_commit`) and the socket the answers go out on.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

import attrs

from openprime.mesh.abort import abort_key, try_group

if TYPE_CHECKING:
    from torch.distributed import Store

    from openprime.mesh.blame import Blame
    from openprime.mesh.stragglers import StragglerClock

log = logging.getLogger("openprime.mesh.coordinator")  # the coordinator's log, as before the split


@attrs.define
class Committee:
    """The members that must report on one all-reduce, and what they reported."""

    step: int
    attempt: int
    epoch: int
    members: frozenset[str]
    ring: tuple[str, ...] = ()  # the members in ring order (the links the all-reduce used)
    doomed: bool = False  # the try's abort key is set (openprime.mesh.abort): it cannot be applied
    reports: dict[str, bool] = attrs.Factory(dict)
    waiting: dict[str, tuple[bytes, int]] = attrs.Factory(dict)  # member -> (route, req) of its report
    reported_at: dict[str, float] = attrs.Factory(dict)  # when each member reported (Coordinator._now)
    unreachable: set[tuple[str, str]] = attrs.Factory(set)  # (member, a member it could not connect to)
    # Members removed during the try: a new process joining under one's id (ids fixed by the caller) is not it.
    gone: set[str] = attrs.Factory(set)

    def live(self, nodes: Collection[str]) -> list[str]:
        """The members still in the run (among `nodes`, the coordinator's) and not removed during the try."""
        return [m for m in self.members if m in nodes and m not in self.gone]


@attrs.define(frozen=True)
class Decision:
    """What the coordinator answers the members that reported: apply the try or not."""

    committee: Committee
    apply: bool


class Commits:
    """The all-reduce whose view went out (its committee) and the decisions taken on earlier tries."""

    def __init__(self, *, run_id: str, store: Store, clock: StragglerClock, blame: Blame) -> None:
        self._run_id = run_id
        self._store = store
        self._clock = clock
        self._blame = blame
        self.committee: Committee | None = None
        # (epoch, step, attempt) -> applied. The epoch tells the tries of a run from those of a later run (its nodes
        # all gone, resumed from an older step or started anew against this coordinator), whose steps and attempts
        # start over: keyed by step and attempt alone, its first tries were answered with the earlier run's
        # decisions, "apply" to a member whose all-reduce had failed.
        self._decisions: dict[tuple[int, int, int], bool] = {}

    def opened(self, *, step: int, attempt: int, epoch: int, members: list[str]) -> None:
        """A view went out: its members report on this try next."""
        self.committee = Committee(step=step, attempt=attempt, epoch=epoch, members=frozenset(members),
                                   ring=tuple(members))

    def report(self, route: bytes, message: dict, *, sent_at: float, epoch: int,
               members: list[str]) -> dict | None:
        """A member's report on its all-reduce: the decision already taken on that try, or None (answered when every
        member has reported). `epoch` and `members` are the coordinator's view, for a committee it must re-form."""
        key = (message["step"], message["attempt"])
        decided = self._decisions.get((message["epoch"], *key))
        if decided is not None:
            return {"op": "decision", "apply": decided}
        committee = self.committee
        if committee is None or (committee.step, committee.attempt) != key:
            # A coordinator that restarted mid-commit: the members re-form the committee as they report.
            self.opened(step=key[0], attempt=key[1], epoch=epoch, members=members)
            committee = self.committee
        node = message["node"]
        committee.reported_at.setdefault(node, sent_at)
        self._clock.reported(message.get("compute_s"))
        committee.reports[node] = message["ok"]
        committee.unreachable.update((node, m) for m in message.get("unreachable") or []
                                     if m in committee.members and m != node)
        if not message["ok"]:
            self.doom(f"node {node} reported that its part failed")
        committee.waiting[node] = (route, message["req"])
        return None

    def removed(self, node: str, why: str) -> None:
        """A member of the try under way was removed: the try cannot be applied."""
        if self.committee is not None and node in self.committee.members:
            self.committee.gone.add(node)
            self.doom(f"node {node} was removed: {why}")

    def doom(self, why: str) -> None:
        """Tell the committee's members that their try cannot be applied, so that they stop waiting on it now
        (abort.py: the others would wait for a frozen member until their deadline, 2(n-1) x op_s)."""
        committee = self.committee
        if committee is None or committee.doomed:
            return
        committee.doomed = True
        key = abort_key(try_group(self._run_id, committee.epoch, committee.step, committee.attempt))
        try:
            self._store.set(key, why)
        except RuntimeError as e:  # the store is in this process: only a broken one fails, and deadlines still act
            log.warning("could not mark outer step %d try %d as doomed: %s", committee.step, committee.attempt, e)

    def decide(self, live: Collection[str], now: float) -> Decision | None:
        """Once every live member of the committee has reported (`live`: those still in the run): the decision,
        which closes the committee; None while a live member has not."""
        committee, live = self.committee, set(live)
        if committee is None or not committee.reports or not live <= set(committee.reports):
            return None
        # Apply only if every member of the view reported success: a member that vanished may not have it.
        apply = live == committee.members and all(committee.reports.values())
        if not apply and live == committee.members:  # nobody was lost, yet a member's all-reduce failed: unexplained
            self._blame.failed(committee.step, committee.ring, committee.unreachable)
        if not apply:
            log.warning("outer step %d try %d not applied: %s", committee.step, committee.attempt,
                        "a member was lost" if live != committee.members else "a member's all-reduce failed")
        return self._close(apply, now)

    def heard(self, message: dict) -> bool | None:
        """How a member's message (any request: its belief; a sync: the try it comes to) shows the open try was
        decided before this coordinator restarted: True (it applied it: the same epoch and step and `applied`, or a
        sync for the next step), False (a sync for the step's next try), or None. Only a committee that has reports
        (its members resend them after a restart; nobody reports on a skipped step's view), and only for the try
        under way: without a restart a member hears the decision only once every member reported, which closes the
        committee, so no member of an open committee has heard it."""
        committee = self.committee
        if (committee is None or not committee.reports or message["node"] not in committee.members
                or message["epoch"] != committee.epoch):
            return None
        sync = message["op"] == "sync"
        if message.get("applied") is True and message["step"] == committee.step + (1 if sync else 0):
            return True
        if sync and message["step"] == committee.step and message["attempt"] > committee.attempt:
            return False
        return None

    def settle(self, apply: bool, now: float) -> Decision:
        """Close the committee with the decision a member's messages show it heard before this coordinator
        restarted (it applied the try, or it retries the step): the members still waiting get the same one.

        Re-formed from the reports after a restart, the committee would wait for that member's report, which never
        comes (it moved on): it was evicted as late, and the others were told the opposite of what it heard."""
        log.warning("outer step %d try %d was %s before this coordinator restarted (a member's messages say so): "
                    "the members still waiting are told the same", self.committee.step, self.committee.attempt,
                    "applied" if apply else "not applied")
        return self._close(apply, now)

    def _close(self, apply: bool, now: float) -> Decision:
        committee = self.committee
        self._decisions[(committee.epoch, committee.step, committee.attempt)] = apply
        if apply:
            self._blame.applied(committee.members, committee.ring)
            self._clock.applied(now)
        self.committee = None
        return Decision(committee=committee, apply=apply)
