"""LinkSuspicion (links.py): the ring of the fewest suspect links, and how many tries one broken link costs."""

import itertools

import pytest

from openprime.mesh.links import EXACT_MAX_NODES, LinkSuspicion, cut_off_node, ring_links, unreachable_node


def _nodes(n):
    return [f"n{i}" for i in range(n)]


def _tries_until_applied(nodes, broken, num_tries):
    """Tries of one outer step, each on the ring the suspicions give, until one's ring avoids `broken`; the try
    that was applied (None if none was) and the suspicion memory after it."""
    links, ring = LinkSuspicion(), list(nodes)
    for attempt in range(num_tries):
        ring = links.ring(ring)
        assert sorted(ring) == sorted(nodes)
        if broken in ring_links(ring):
            links.failed(ring)
        else:
            links.worked(ring_links(ring))
            return attempt, links, ring
    return None, links, ring


@pytest.mark.parametrize("n", [4, 5, 6, 9, 12])
def test_one_broken_link_is_avoided_within_three_tries_and_from_five_nodes_at_the_first_retry(n):
    nodes = _nodes(n)
    for a, b in itertools.combinations(nodes, 2):
        applied, links, ring = _tries_until_applied(nodes, frozenset((a, b)), num_tries=3)
        assert applied is not None, (a, b)
        if n >= 5:
            assert applied <= 1, (a, b, applied)
        assert frozenset((a, b)) not in ring_links(ring)
        # The ring that worked stays: its links are trusted; the broken one is suspect if a try failed on it.
        assert links.ring(ring) == ring and links.suspect(a, b) == (applied > 0)


def test_four_nodes_need_the_third_try_when_the_retry_s_ring_holds_the_broken_link_too():
    # K4 has three rings; each link is on two. Which of the two others the retry takes is fixed (the first ring in
    # order of the fewest suspicions); for the links on it the third try is the one.
    nodes = _nodes(4)
    attempts = {}
    for a, b in itertools.combinations(nodes, 2):
        attempts[a + b], _, _ = _tries_until_applied(nodes, frozenset((a, b)), num_tries=3)
    assert attempts["n0n2"] == attempts["n1n3"] == 0  # not on the first ring
    assert sorted(attempts.values()) == [0, 0, 1, 1, 2, 2]


def test_three_nodes_or_fewer_keep_their_only_ring():
    links = LinkSuspicion()
    links.failed(["a", "b", "c"])
    assert links.ring(["a", "b", "c"]) == ["a", "b", "c"]
    links.failed(["a", "b"])
    assert links.ring(["a", "b"]) == ["a", "b"]


def test_without_suspect_links_on_it_the_current_order_is_kept():
    links = LinkSuspicion()
    assert links.ring(["c", "a", "d", "b"]) == ["c", "a", "d", "b"]
    links.failed(["x", "y", "z", "w"])  # other nodes' links
    assert links.ring(["c", "a", "d", "b"]) == ["c", "a", "d", "b"]


def test_data_across_a_link_trusts_it_again_and_a_node_that_leaves_takes_its_links_along():
    links = LinkSuspicion()
    links.failed(["a", "b", "c", "d"])
    links.failed(["a", "b", "d", "c"])
    assert links.failures[frozenset("ab")] == 2 and links.score(["a", "b", "c", "d"]) == 6
    links.worked([frozenset("ab")])
    assert not links.suspect("a", "b") and links.suspect("b", "c")
    links.forget("c")
    assert set(links.failures) == {frozenset("da"), frozenset("bd")}


@pytest.mark.parametrize("n", [EXACT_MAX_NODES + 1, 16, 40])
def test_above_the_exact_size_the_search_still_finds_a_ring_clear_of_a_failed_one(n):
    nodes = _nodes(n)
    links = LinkSuspicion()
    links.failed(nodes)
    ring = links.ring(nodes)
    assert sorted(ring) == sorted(nodes) and ring[0] == nodes[0]
    assert links.score(ring) == 0
    assert links.ring(nodes) == ring  # deterministic


def _reports(*pairs):
    return {frozenset(p) for p in pairs}


def test_a_node_nobody_reaches_is_singled_out_from_three_nodes_on():
    for others in (["a", "b"], ["a", "b", "c", "d"]):
        tries = [_reports(*[("x", o) for o in others]), _reports(*[(o, "x") for o in others[:2]])]
        assert unreachable_node(tries) == "x"


def test_a_broken_link_or_a_try_s_noise_singles_out_nobody():
    assert unreachable_node([_reports(("a", "b")), _reports(("b", "a"))]) is None  # either may be the healthy one
    # "x" is in the reports of the first try only (a connection refused by a member that had aborted the try).
    assert unreachable_node([_reports(("x", "a"), ("x", "b")), _reports(("a", "b"))]) is None
    assert unreachable_node([_reports(("x", "a"), ("x", "b")), set()]) is None  # a try failed for another reason
    assert unreachable_node([_reports(("x", "a"), ("x", "b"), ("y", "c"), ("y", "d"))]) is None  # two as bad
    assert unreachable_node([]) is None


def test_one_end_of_a_link_that_no_ring_avoids_is_cut_off_the_newest_on_a_tie():
    ab, bc = frozenset("ab"), frozenset("bc")
    assert cut_off_node([{ab}, {ab}], ["a", "b"]) == "b"  # two nodes: the newer leaves, the older trains on
    assert cut_off_node([{ab}, {ab}], ["b", "a"]) == "a"
    assert cut_off_node([{ab, bc}, {ab, bc}], ["b", "a", "c"]) == "b"  # on two broken links, though the oldest
    assert cut_off_node([{ab}, {bc}], ["a", "b", "c"]) is None  # broken in one try each: noise
    assert cut_off_node([{ab}, {ab}], ["a", "b", "c", "d"]) is None  # a ring of four goes round one link
    assert cut_off_node([{ab}, {ab}], ["a", "c", "d"]) is None  # b left: its link with it
    assert cut_off_node([], ["a", "b"]) is None
