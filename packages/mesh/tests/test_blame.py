"""openprime.mesh.blame: what unexplained failed tries lead the coordinator to do, without a coordinator."""

from __future__ import annotations

from openprime.mesh.blame import NUM_CUT_OFF_STEPS, Blame, Culprit
from openprime.mesh.links import ring_links

NODES = ["a", "b", "c", "d", "e"]


def _fail_all(blame: Blame, step: int, ring: list[str], unreachable: set[tuple[str, str]] = frozenset()) -> None:
    for _ in range(blame.num_tries):
        blame.failed(step, ring, set(unreachable))


def test_joiners_admitted_since_the_ring_worked_are_the_culprits_only_once_every_try_failed():
    blame = Blame(num_tries=3)
    blame.admitted(["e"])
    blame.failed(7, NODES, set())
    blame.failed(7, NODES, set())
    assert blame.unproven_culprits(NODES, 7) == []  # a try left
    blame.failed(7, NODES, set())
    assert blame.unproven_culprits(NODES, 7) == ["e"]
    assert blame.unproven_culprits(NODES, 8) == []  # another outer step's tries say nothing yet


def test_nobody_is_a_culprit_when_every_member_is_unproven_or_the_ring_worked_since():
    blame = Blame(num_tries=2)
    blame.admitted(NODES)
    _fail_all(blame, 0, NODES)
    assert blame.unproven_culprits(NODES, 0) == []  # all new: nothing tells who is at fault
    blame.admitted(["e"])
    blame.applied(NODES, NODES)  # e took part in an applied all-reduce: proven
    _fail_all(blame, 1, NODES)
    assert blame.unproven_culprits(NODES, 1) == []


def test_a_step_with_a_try_explained_by_a_lost_member_singles_out_nobody():
    blame = Blame(num_tries=3)
    blame.admitted(["e"])
    # Only two tries failed with every member alive; the third was explained (the coordinator records nothing).
    everyone_cut_off_from_e = {(m, "e") for m in NODES[:4]} | {("e", m) for m in NODES[:4]}
    blame.failed(3, NODES, everyone_cut_off_from_e)
    blame.failed(3, NODES, everyone_cut_off_from_e)
    assert blame.unproven_culprits(NODES, 3) == [] and blame.unreachable_culprit(3, NODES) is None
    blame.failed(3, NODES, everyone_cut_off_from_e)
    assert blame.unreachable_culprit(3, NODES) == Culprit(node="e", unreached=("a", "b", "c", "d"), steps=(3,))


def test_only_links_both_ends_reported_count_as_broken():
    blame = Blame(num_tries=1)
    # e closed its transport after aborting: the others' later connections to it were refused, one way only.
    blame.failed(0, NODES, {(m, "e") for m in NODES[:4]})
    assert blame.unreachable_culprit(0, NODES) is None


def test_a_suspect_link_is_left_out_of_the_ring_and_bandwidth_never_brings_it_back():
    blame = Blame(num_tries=3)
    blame.failed(0, NODES, set())
    fast = set(ring_links(NODES))
    bandwidth = {(x, y): 1e9 if frozenset((x, y)) in fast else 1e6 for x in NODES for y in NODES if x != y}
    order, why = blame.ring(NODES, bandwidth, reorder_gain=2.0)
    assert why is not None and "with every member alive" in why
    assert not set(ring_links(order)) & fast  # n = 5: the pentagram, none of the failed ring's links
    blame.applied(order, order)  # the new ring worked: its links are trusted; the failed ring's stay suspect
    order_after, why_after = blame.ring(order, bandwidth, reorder_gain=2.0)
    assert (order_after, why_after) == (order, None)  # 1000x faster links, but suspect ones: no bandwidth
    for x, y in fast:
        blame.probed(x, y)  # probes moved data across them again
    order_probed, why_probed = blame.ring(order, bandwidth, reorder_gain=2.0)
    assert set(ring_links(order_probed)) == fast and why_probed.startswith("for bandwidth")


def test_bandwidth_reorders_only_above_the_gain_and_forget_drops_a_nodes_links():
    blame = Blame(num_tries=3)
    ring = ["a", "b", "c", "d"]
    bandwidth = {(x, y): 1e8 for x in ring for y in ring if x != y}
    bandwidth[("a", "b")] = bandwidth[("b", "a")] = 6e7  # the current ring's slowest link: 1.67x slower
    assert blame.ring(ring, bandwidth, reorder_gain=2.0) == (ring, None)
    order, why = blame.ring(ring, bandwidth, reorder_gain=1.5)
    assert frozenset(("a", "b")) not in ring_links(order) and "1.7x" in why
    blame.failed(0, ring, set())
    blame.forget("a")
    assert blame.links.score(ring) == 2  # b-c and c-d stay suspect; a's two links went with it


def _both_ways(*links: tuple[str, str]) -> set[tuple[str, str]]:
    return {p for a, b in links for p in ((a, b), (b, a))}


def test_one_end_of_a_link_no_ring_avoids_leaves_once_outer_steps_in_a_row_failed_over_it():
    # Three nodes have one ring: a broken link fails every try. One outer step skipped is a blip; after
    # NUM_CUT_OFF_STEPS in a row, the end that joined last leaves (members are given oldest joiner first).
    assert NUM_CUT_OFF_STEPS == 2
    blame, three = Blame(num_tries=2), ["a", "b", "c"]
    _fail_all(blame, 4, three, _both_ways(("a", "c")))
    assert blame.unreachable_culprit(4, three) is None
    _fail_all(blame, 5, three, _both_ways(("a", "c")))
    assert blame.unreachable_culprit(5, three) == Culprit(node="c", unreached=("a",), steps=(4, 5))
    assert blame.unreachable_culprit(5, ["c", "b", "a"]).node == "a"  # a joined last


def test_steps_not_in_a_row_or_another_link_each_time_or_an_avoidable_link_evict_nobody():
    three = ["a", "b", "c"]
    blame = Blame(num_tries=2)
    _fail_all(blame, 4, three, _both_ways(("a", "c")))
    _fail_all(blame, 6, three, _both_ways(("a", "c")))  # step 5 was applied (or failed otherwise)
    assert blame.unreachable_culprit(6, three) is None
    blame = Blame(num_tries=2)
    _fail_all(blame, 4, three, _both_ways(("a", "c")))
    _fail_all(blame, 5, three, _both_ways(("b", "c")))  # no link broken in every try: a flapping network
    assert blame.unreachable_culprit(5, three) is None
    blame = Blame(num_tries=2)
    _fail_all(blame, 4, three, set())  # Gloo reports nobody: nothing to go on
    _fail_all(blame, 5, three, set())
    assert blame.unreachable_culprit(5, three) is None
    # Four nodes: some ring avoids one broken link (the next try takes it), so nobody leaves for it.
    blame, four = Blame(num_tries=2), ["a", "b", "c", "d"]
    _fail_all(blame, 4, four, _both_ways(("a", "b")))
    _fail_all(blame, 5, four, _both_ways(("a", "b")))
    assert blame.unreachable_culprit(5, four) is None


def test_two_sites_cut_apart_keep_the_larger_one_its_other_nodes_leaving_one_step_at_a_time():
    # Sites {a, b} and {c, d, e}: every ring crosses between them twice. Each of a and b is on 3 broken links,
    # each of c, d, e on 2: b (the newer of a and b) leaves first, though a and b joined first; then a is singled
    # out by unreachable_node.
    blame, nodes = Blame(num_tries=2), ["a", "b", "c", "d", "e"]
    cut = _both_ways(*[(x, y) for x in "ab" for y in "cde"])
    _fail_all(blame, 1, nodes, cut)
    _fail_all(blame, 2, nodes, cut)
    assert blame.unreachable_culprit(2, nodes) == Culprit(node="b", unreached=("c", "d", "e"), steps=(1, 2))
    blame.forget("b")
    rest = ["a", "c", "d", "e"]
    _fail_all(blame, 3, rest, {p for p in cut if "b" not in p})
    assert blame.unreachable_culprit(3, rest) == Culprit(node="a", unreached=("c", "d", "e"), steps=(3,))


def test_the_donor_is_the_first_holder_whose_link_to_the_new_nodes_was_not_reported_broken():
    blame, holders = Blame(num_tries=3), ["a", "b", "c"]
    assert blame.donor(holders, []) is None and blame.donor([], ["j"]) is None
    assert blame.donor(holders, ["j"]) == "a"
    blame.failed(7, [*holders, "j"], _both_ways(("a", "j")))  # the joiner and the first holder cannot connect
    assert blame.donor(holders, ["j"]) == "b"
    assert blame.donor(holders, ["k"]) == "a"  # another joiner: a reaches it
    blame.failed(7, [*holders, "j", "k"], _both_ways(("a", "j"), ("b", "k")))
    assert blame.donor(holders, ["j", "k"]) == "c"  # one donor serves every new node
    blame.failed(7, [*holders, "j"], _both_ways(("a", "j"), ("b", "j"), ("c", "j")))
    assert blame.donor(holders, ["j"]) == "a"  # nobody reaches it: the first, as before (it is refused later)
    blame = Blame(num_tries=3)
    blame.failed(7, [*holders, "j"], {("a", "j")})  # reported by one end only: noise, as everywhere else
    assert blame.donor(holders, ["j"]) == "a"
