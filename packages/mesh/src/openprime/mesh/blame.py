"""Who is at fault when an outer step's all-reduce fails with every member alive, and which ring to use next.

A try that fails because a member was lost is explained by that loss: the next view leaves the member out.
A try that fails with every member alive and reporting is *unexplained*: a member's transport could not
exchange data with another one. The coordinator learns three things from such tries, kept here:
- the links of their rings are suspect (links.LinkSuspicion): the next view's ring avoids them, so a link
  broken between two members is left out of the ring;
- the members admitted into a ring that worked without them, not yet members of an applied all-reduce
  (`unproven`): if every try of an outer step fails after their admission, they are what changed, and are
  refused;
- the links both of whose ends reported they could not connect over them (`Transport.unreachable`): the donor
  of a view that admits nodes is a holder of the state with no such link to them (it sends them the state
  directly, whatever the ring); a node that these single out over every try of an outer step
  (links.unreachable_node) is evicted; so is one end of links that no ring avoids, once `NUM_CUT_OFF_STEPS`
  outer steps in a row failed on every try with them reported broken (links.cut_off_node: 3 nodes or fewer,
  two sites cut apart), since every outer step of the rest of the run would be skipped and the replicas would
  drift apart.
An applied all-reduce proves its members and its ring's links; a bandwidth probe that moved data proves its
link. The coordinator asks, once an outer step has failed on all `num_tries` tries, whom to refuse or evict
(it does so and words the log); this module only remembers and decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from openprime.mesh.links import LinkSuspicion, cut_off_node, ring_links, unreachable_node
from openprime.mesh.ring_order import best_ring, ring_bottleneck

__all__ = ["NUM_CUT_OFF_STEPS", "Blame", "Culprit"]

#: Outer steps in a row that must fail on every try, the same links reported broken in each, which no ring avoids,
#: before one end of them is evicted. One is a blip (a route that flapped): the step is skipped and the next one
#: tries again. Two cost two skipped outer steps, where an eviction costs the evicted node a state transfer (30-60
#: minutes for INTELLECT-1's 10B model) when it rejoins.
NUM_CUT_OFF_STEPS = 2


@attrs.frozen(kw_only=True)
class Culprit:
    """A node to evict because the others cannot exchange data with it."""

    node: str  #: the node
    unreached: tuple[str, ...]  #: the members it and they could not connect to each other
    steps: tuple[int, ...]  #: the outer steps whose every try failed so (more than one: links.cut_off_node)


class Blame:
    """The coordinator's memory of unexplained failed tries, and the decisions drawn from it."""

    def __init__(self, num_tries: int) -> None:
        self.num_tries = num_tries  # mesh.num_all_reduce_tries: an outer step fails for good after this many
        self.links = LinkSuspicion()  # links on rings whose tries failed with every member alive (links.py)
        # Nodes admitted into a running ring that have not yet been members of an applied all-reduce.
        self.unproven: set[str] = set()
        # Outer step -> its tries that failed with every member alive, each as the links both of whose ends
        # reported that they could not connect over it. The newest NUM_CUT_OFF_STEPS steps are kept.
        self._unexplained: dict[int, list[set[frozenset[str]]]] = {}

    # ------------------------------------------------------------------ what happened

    def admitted(self, joiners: Sequence[str]) -> None:
        """Joiners admitted into a ring that worked: they prove themselves in an applied all-reduce."""
        self.unproven.update(joiners)

    def applied(self, members: Sequence[str], ring: Sequence[str]) -> None:
        """An all-reduce was applied: its members and its ring's links worked."""
        self.unproven -= set(members)
        self.links.worked(ring_links(ring))

    def probed(self, a: str, b: str) -> None:
        """A bandwidth probe moved data between a and b: their link works."""
        self.links.worked([frozenset((a, b))])

    def failed(self, step: int, ring: Sequence[str], unreachable: set[tuple[str, str]]) -> None:
        """A try of `step` on `ring` failed with every member alive. `unreachable`: (member, a member its
        transports could not connect to). A link counts as broken when both of its ends reported it: a member
        that aborted the try and closed its transport refuses the connections that come after, but by then its
        own connections were made or given up."""
        self.links.failed(ring)  # a link of its ring, perhaps: the next view's ring avoids them
        broken = {frozenset(p) for p in unreachable if (p[1], p[0]) in unreachable}
        kept = {s: tries for s, tries in self._unexplained.items() if step - NUM_CUT_OFF_STEPS < s < step}
        self._unexplained = {**kept, step: [*self._unexplained.get(step, []), broken]}

    def forget(self, node: str) -> None:
        """The node left the run (removed or refused): it comes back, if at all, as a new node."""
        self.unproven.discard(node)
        self.links.forget(node)

    # ------------------------------------------------------------------ decisions

    def all_tries_unexplained(self, step: int) -> bool:
        """Every try of `step` failed with every member alive (none is explained by a member that was lost)."""
        return len(self._unexplained.get(step, [])) >= self.num_tries

    def unproven_culprits(self, live_members: Sequence[str], step: int) -> list[str]:
        """The members to refuse after every try of `step` failed unexplained: those admitted since the ring last
        worked. None if every member is unproven (nothing tells who is at fault) or a try is explained."""
        culprits = [m for m in live_members if m in self.unproven]
        if not culprits or len(culprits) == len(live_members) or not self.all_tries_unexplained(step):
            return []
        return culprits

    def unreachable_culprit(self, step: int, members: Sequence[str]) -> Culprit | None:
        """The node to evict after every try of `step` failed unexplained, and the members it could not reach; None
        if nobody is to be. `members`: the live members, oldest joiner first. The node that what the members could
        not connect to singles out (links.unreachable_node); else, once the `NUM_CUT_OFF_STEPS` outer steps up to
        `step` all failed so, one end of the links broken in a try of each of them that no ring avoids
        (links.cut_off_node)."""
        if not self.all_tries_unexplained(step):
            return None
        tries = self._unexplained[step]
        node = unreachable_node(tries)
        if node is not None:  # the members it could not reach, in any try
            unreached = {peer for broken in tries for link in broken if node in link for peer in link} - {node}
            return Culprit(node=node, unreached=tuple(sorted(unreached)), steps=(step,))
        steps = range(step - NUM_CUT_OFF_STEPS + 1, step + 1)
        if not all(self.all_tries_unexplained(s) for s in steps):
            return None
        # Per outer step, the links broken in any of its tries: a member that aborted a try before its transport
        # tried a link reports nothing of it (transports connect in the background), so one try may miss a link.
        per_step = [set().union(*self._unexplained[s]) for s in steps]
        node = cut_off_node(per_step, members)
        if node is None:
            return None
        unreached = {peer for link in set.intersection(*per_step) if node in link for peer in link} - {node}
        return Culprit(node=node, unreached=tuple(sorted(unreached)), steps=tuple(steps))

    def donor(self, holders: Sequence[str], new: Sequence[str]) -> str | None:
        """The holder of the state that sends it to the `new` nodes: the first of `holders` (ring order) with no link
        to any of them that both ends reported broken in the failed tries kept; the first if every one has such a
        link. None without new nodes or holders. The transfer goes from the donor to each new node directly, so a
        joiner cut off from the first holder alone would otherwise fail every try and be refused."""
        if not holders or not new:
            return None
        broken = {link for tries in self._unexplained.values() for links in tries for link in links}
        return next((h for h in holders if not any(frozenset((h, j)) in broken for j in new)), holders[0])

    def ring(self, current: Sequence[str], bandwidth: Mapping[tuple[str, str], float],
             reorder_gain: float) -> tuple[list[str], str | None]:
        """The next view's ring, and why it is not `current` (None where it is), for the log.

        `current` (the live members, the joiners appended) unless links of it are suspect (then the ring of the
        fewest suspicions), or the measured bandwidths (`bandwidth[(from, to)]`, bytes/s) give a ring whose slowest
        link is at least `reorder_gain` times faster; a suspect link counts as one of no bandwidth, so bandwidth
        never brings it back."""
        current = list(current)
        if self.links.score(current):
            order = self.links.ring(current)
            if order == current:
                return current, None
            suspects = ", ".join(f"{'-'.join(sorted(link))} x{n}" for link, n in self.links.failures.items()
                                 if link <= set(current))
            return order, f"around links on which tries failed with every member alive ({suspects})"
        if len(current) < 3 or not bandwidth:
            return current, None
        matrix = np.array([[0.0 if self.links.suspect(a, b) else bandwidth.get((a, b), 0.0) for b in current]
                           for a in current])
        order = best_ring(matrix)
        gain = ring_bottleneck(matrix, order) / max(ring_bottleneck(matrix, range(len(current))), 1e-9)
        if gain < reorder_gain:
            return current, None
        return [current[i] for i in order], f"for bandwidth (slowest link {gain:.1f}x faster)"
