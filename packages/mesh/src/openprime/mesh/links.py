"""Links that failed: the ring orders that keep nodes which could not exchange data apart.

A ring all-reduce of n nodes uses n of the n(n-1)/2 links between them: each node sends only to the next
one in the ring. A link can break while both of its nodes stay in touch with the coordinator: a route
between two sites fails, a firewall or a NAT mapping changes on one side, a path drops large packets. Then
every try of every outer step fails with every member alive (the coordinator calls such a try
unexplained) and, before this module, every outer step of the run was skipped from then on: the nodes
trained on alone and their replicas drifted apart, with a warning per step.

Nothing in a failed try says which link broke: members time out at about the same moment, each naming the
neighbour it waited for. But the ring can change. Each unexplained failure makes every link of its ring a
suspect (counted once per such try), a link is trusted again once data crossed it (its ring's all-reduce
was applied, or a bandwidth probe measured it), and each view's ring is the one with the fewest suspicions
(the sum of their counts; the current order where it does as well, so a run without failures keeps its
order and its groups). One broken link then costs:
- n = 4: K4 has three rings, and each link is on two of them. The retry takes a ring that shares two links
  with the failed one and the third try the ring made of the links each tried ring missed; one of the
  two avoids the broken link, so the step is applied by its third try (`mesh.num_all_reduce_tries` is 3).
- n >= 5: a ring that shares no link with the failed one exists, so the first retry avoids the broken link
  (n = 5: the links the failed ring did not use form another ring, the pentagram; n >= 6: Dirac's theorem,
  every node keeps n - 3 >= n/2 of its n - 1 links).
- n <= 3: there is only one ring; failed tries skip the step, and `cut_off_node` (below) ends it.
A node all of whose links broke is on every ring with two of them: ordering cannot avoid it, and these
counts cannot find it (every ring holds every node twice, so every node is as suspect as any other). What
finds it is what the members say when a try fails: the members their transports could not connect to
(`Transport.unreachable`: refused, reset or timed out, as a firewall or a dead route leaves them). A link
counts as broken in a try when both of its ends report it: once a member aborts a doomed try and closes
its transport, connections to it are refused too, but only one way (its own were made or given up
before). `unreachable_node` singles out a node that the broken links of every failed try of an outer step
hold, paired with at least two other nodes, more than any other node; the coordinator evicts it once
the outer step has failed on all its tries (it rejoins as a new node, and is refused if it still breaks
the ring). A single broken link names two nodes, each paired with one: nobody is singled out, and the
ring goes round it.

Where no ring goes round the broken links (3 nodes or fewer, which have one ring; two sites that cannot reach
each other, every ring crossing between them twice), every outer step would be skipped for the rest of the run
and the replicas would drift apart. `cut_off_node` names one end of them to leave: once outer steps in a row
(blame.py) have failed on all their tries, the same links reported broken both ways in each, and no ring of
the members avoids them all, the node on the most of those links, the newest of them on a tie. Of two sites,
the smaller one's nodes are on more of the broken links, and leave one an outer step (the larger site goes on;
of equal ones, the site of the newest node leaves). The node rejoins as a new node; if the link is still broken,
it is refused as a joiner that breaks a ring that worked without it, with the way to check it.

For up to `EXACT_MAX_NODES` nodes every ring is scored; above, a 2-opt search from the current order
(reverse a stretch of the ring while that lowers the sum) finds a ring of few suspicions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

__all__ = ["EXACT_MAX_NODES", "LinkSuspicion", "cut_off_node", "ring_links", "unreachable_node"]

#: Up to this many nodes every ring is scored: (n - 1)! orders, 5040 at 8 nodes (about 20 ms).
EXACT_MAX_NODES = 8


def _pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


def ring_links(ring: Sequence[str]) -> list[frozenset[str]]:
    """The links a ring uses: each node to the next, the last back to the first (none for a single node)."""
    if len(ring) < 2:
        return []
    if len(ring) == 2:
        return [_pair(ring[0], ring[1])]
    return [_pair(a, b) for a, b in zip(ring, [*ring[1:], ring[0]], strict=True)]


class LinkSuspicion:
    """The coordinator's memory of links on rings whose tries failed unexplained, and the ring that avoids them."""

    def __init__(self) -> None:
        self.failures: dict[frozenset[str], int] = {}  # link -> unexplained failed tries whose ring held it

    def failed(self, ring: Sequence[str]) -> None:
        """A try on this ring failed with every member alive: each of its links is suspect once more."""
        for link in ring_links(ring):
            self.failures[link] = self.failures.get(link, 0) + 1

    def worked(self, links: Iterable[frozenset[str]]) -> None:
        """Data crossed these links (an applied all-reduce, a bandwidth probe): trusted again."""
        for link in links:
            self.failures.pop(link, None)

    def forget(self, node: str) -> None:
        """The node left the run: its links go with it (it comes back, if at all, as a new chance)."""
        for link in [link for link in self.failures if node in link]:
            del self.failures[link]

    def suspect(self, a: str, b: str) -> bool:
        return _pair(a, b) in self.failures

    def score(self, ring: Sequence[str]) -> int:
        """The ring's suspicions: the sum over its links of their failed tries."""
        return sum(self.failures.get(link, 0) for link in ring_links(ring))

    def ring(self, current: Sequence[str]) -> list[str]:
        """The ring of the fewest suspicions; `current` (its order kept) where no ring does better."""
        current = list(current)
        best, best_score = current, self.score(current)
        if best_score == 0 or len(current) < 4:
            return best  # with 3 nodes or fewer every order uses the same links
        if len(current) <= EXACT_MAX_NODES:
            first, rest = current[0], current[1:]
            for perm in itertools.permutations(rest):  # the first is `current` itself: ties keep it
                score = self.score([first, *perm])
                if score < best_score:
                    best, best_score = [first, *perm], score
                    if score == 0:
                        break
            return best
        return self._two_opt(current)

    def _two_opt(self, ring: list[str]) -> list[str]:
        """Reverse ring[i:j + 1] while that lowers the score; each reversal swaps two links for two others,
        (ring[i-1], ring[i]) and (ring[j], ring[j+1]) for (ring[i-1], ring[j]) and (ring[i], ring[j+1])."""
        n = len(ring)
        ring = list(ring)

        def w(a: str, b: str) -> int:
            return self.failures.get(_pair(a, b), 0)

        improved = True
        while improved:  # every pass that goes on lowers the score by at least 1: at most score(ring) passes
            improved = False
            for i in range(1, n - 1):
                for j in range(i + 1, n):
                    before, after = ring[i - 1], ring[(j + 1) % n]
                    delta = w(before, ring[j]) + w(ring[i], after) - w(before, ring[i]) - w(ring[j], after)
                    if delta < 0:
                        ring[i:j + 1] = reversed(ring[i:j + 1])
                        improved = True
        return ring


def unreachable_node(tries: Sequence[set[frozenset[str]]]) -> str | None:
    """The node that the unreachable reports of an outer step's failed tries single out, or None.

    `tries`: per failed try, its broken links (both ends reported the other unreachable). The node must be in one of
    every try (a link that broke for good, not one try's noise, such as a connection refused by a member that had
    just aborted the try), paired with at least two other nodes over the tries (one pair is a broken link, and
    either of its nodes may be the healthy one), and paired with more nodes than any other node is.
    """
    if not tries or not all(tries):
        return None
    partners: dict[str, set[str]] = {}
    for pairs in tries:
        for pair in pairs:
            a, b = sorted(pair)
            partners.setdefault(a, set()).add(b)
            partners.setdefault(b, set()).add(a)
    in_every = set.intersection(*({node for pair in pairs for node in pair} for pairs in tries))
    ranked = sorted(partners, key=lambda node: (-len(partners[node]), node))
    best = ranked[0]
    if best not in in_every or len(partners[best]) < 2:
        return None
    if len(ranked) > 1 and len(partners[ranked[1]]) == len(partners[best]):
        return None
    return best


def cut_off_node(tries: Sequence[set[frozenset[str]]], members: Sequence[str]) -> str | None:
    """One end of the links broken in every one of `tries` that no ring of `members` avoids, or None.

    `tries`: per failed try (or outer step), its broken links (both ends reported the other unreachable). `members`:
    oldest joiner first. None when no link was broken in every one (noise, or a network that flaps), or when some
    ring of the members uses none of those links (the next try's ring goes round them: LinkSuspicion). Otherwise the
    node on the most of them, the newest member on a tie.
    """
    if not tries:
        return None
    broken = {link for link in set.intersection(*map(set, tries)) if link <= set(members)}
    if not broken:
        return None
    avoid = LinkSuspicion()
    avoid.failures = dict.fromkeys(broken, 1)
    if avoid.score(avoid.ring(members)) == 0:
        return None
    on_links = {node: sum(node in link for link in broken) for node in members}
    return max(reversed(members), key=lambda node: on_links[node])  # max keeps the first of equals: the newest
