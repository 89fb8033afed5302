"""Ring order for the cross-node all-reduce: a bottleneck travelling-salesman solver.

INTELLECT-1 (arXiv 2412.01152, the ElasticDeviceMesh section) measures the bandwidth between every pair
of nodes and orders the ring all-reduce so that the slowest link on the ring is as fast as possible. A
ring all-reduce moves the same amount of data over every link of the cycle at the same time, so its
duration is set by the slowest link: the right objective is the *bottleneck* (max-min) travelling
salesman problem, not the usual sum of costs.

Problem. Given an n x n matrix ``bandwidth`` where ``bandwidth[i, j]`` is the measured rate from node i
to node j (possibly asymmetric; the diagonal is ignored; NaN or 0 means "not measured" and counts as the
worst possible rate, 0), find a cyclic order ``o`` of all nodes maximising::

    min(bandwidth[o[k], o[(k + 1) % n]] for k in range(n))

Data flows from each node to the next one in the order, and from the last node back to the first.

Algorithm. The optimum is one of the matrix's entries, and "is there a ring whose every link is at least
t" is monotone in t, so both solvers search over the sorted distinct entries for the largest feasible
threshold t, i.e. the largest t whose threshold graph (the directed edges with bandwidth >= t) has a
Hamiltonian cycle:

- up to ``EXACT_MAX_NODES`` nodes, exactly: a Held-Karp style bitmask dynamic programme decides
  Hamiltonicity in O(2^n * n) word operations (each entry is a bitmask of path end nodes, so one AND
  tests all of them), vectorised with numpy one subset size at a time; the binary search over the at most
  n^2 thresholds needs O(log n) such checks. The returned ring is the lexicographically smallest optimal
  one (node 0 first).
- above that, heuristically: the same binary search, trying the upper bound first, with a bounded
  depth-first search for the cycle in place of the dynamic programme. The search fixes one edge at a
  time (most constrained node first) and propagates the consequences: a node left with one way in or
  out owns that edge, and an edge that would close a chain of owned edges into a cycle shorter than n is
  removed. On Python-int bitsets a step costs O(n) word operations. The work per threshold is bounded by
  a count of steps (``HEURISTIC_SEARCH_STEPS``), not by a clock, so the result is deterministic; a
  threshold whose search gives up is treated as infeasible.

Both solvers start from a lower bound (the best greedy max-bottleneck tour) and an upper bound (the
largest t whose threshold graph is strongly connected and has a cycle cover, two conditions every
Hamiltonian graph meets), so the binary search only covers the thresholds between them. When the
heuristic reaches the upper bound its ring is provably optimal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["EXACT_MAX_NODES", "HEURISTIC_SEARCH_STEPS", "best_ring", "ring_bottleneck", "rotate_to"]

#: Largest number of nodes ``best_ring`` solves exactly by default. The dynamic programme holds 2^(n-1)
#: bitmasks plus index arrays of about 8 * n * 2^n bytes: at n = 16 that is 4 MB and a solve takes tens of
#: milliseconds; each further node doubles time and memory.
EXACT_MAX_NODES = 16

# Hard ceiling for the ``exact_max_nodes`` argument: n = 20 already takes about 0.4 s and 80 MB.
_EXACT_CEILING = 20

#: Search steps (edge choices) the heuristic may spend per threshold it tries.
HEURISTIC_SEARCH_STEPS = 1000


def best_ring(
    bandwidth: np.ndarray | Sequence[Sequence[float]], *, exact_max_nodes: int = EXACT_MAX_NODES
) -> list[int]:
    """Return a ring order of all nodes that maximises the slowest link on the ring.

    ``bandwidth[i, j]`` is the measured rate (bytes/s) from node i to node j. The matrix may be
    asymmetric; the diagonal is ignored; NaN or 0 marks an unknown rate, treated as 0 (the worst), and a
    ring is returned whatever the matrix holds. The result starts with node 0 and lists every node once;
    data flows from each node to the next and from the last back to node 0.

    Exact (the lexicographically smallest optimal ring) for up to ``exact_max_nodes`` nodes (at most
    20; rings of up to 3 nodes are always compared directly); a deterministic heuristic above that (see
    the module docstring).
    """
    if not 0 <= exact_max_nodes <= _EXACT_CEILING:
        raise ValueError(f"exact_max_nodes must be in [0, {_EXACT_CEILING}], got {exact_max_nodes}")
    bw = _clean(bandwidth)
    n = bw.shape[0]
    if n <= 3:
        return _enumerate_rings(bw)
    if n <= exact_max_nodes:
        return _exact_ring(bw)
    return _heuristic_ring(bw)


def ring_bottleneck(bandwidth: np.ndarray | Sequence[Sequence[float]], order: Sequence[int]) -> float:
    """Return the smallest bandwidth on the cycle ``order[0] -> order[1] -> ... -> order[-1] -> order[0]``.

    Unknown (NaN) entries count as 0. A single node has no links, so its bottleneck is ``math.inf``.
    """
    bw = _clean(bandwidth)
    n = bw.shape[0]
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n}), got {list(order)}")
    return _bottleneck(bw, order)


def rotate_to(order: Sequence[int], first: int) -> list[int]:
    """Return the same cycle as ``order``, listed from ``first``."""
    order = list(order)
    k = order.index(first)  # raises ValueError when first is not on the ring
    return order[k:] + order[:k]


# ---------------------------------------------------------------------------------------------------------
# Input, bounds and bitsets shared by both solvers.


def _clean(bandwidth: np.ndarray | Sequence[Sequence[float]]) -> np.ndarray:
    """Validate the matrix and return a float64 copy with unknown entries and the diagonal set to 0."""
    bw = np.array(bandwidth, dtype=np.float64)
    if bw.ndim != 2 or bw.shape[0] != bw.shape[1] or bw.shape[0] == 0:
        raise ValueError(f"bandwidth must be a non-empty square matrix, got shape {bw.shape}")
    bw[np.isnan(bw)] = 0.0
    np.fill_diagonal(bw, 0.0)
    if (bw < 0).any():
        raise ValueError("bandwidth must not be negative")
    return bw


def _bottleneck(bw: np.ndarray, order: Sequence[int]) -> float:
    """ring_bottleneck for an already cleaned matrix and a known-valid order."""
    if len(order) == 1:
        return math.inf
    nodes = np.asarray(order, dtype=np.intp)
    return float(bw[nodes, np.roll(nodes, -1)].min())  # link k runs from order[k] to order[k + 1]


def _edge_values(bw: np.ndarray) -> np.ndarray:
    """Sorted distinct off-diagonal entries: the only thresholds at which the answer can change."""
    off_diagonal = ~np.eye(bw.shape[0], dtype=bool)
    return np.unique(bw[off_diagonal])


def _bitsets(bw: np.ndarray, threshold: float) -> tuple[list[int], list[int]]:
    """Successor and predecessor sets of the threshold graph, one Python int per node (bit j = node j)."""
    adj = bw >= threshold
    np.fill_diagonal(adj, False)

    def rows_as_ints(matrix: np.ndarray) -> list[int]:
        packed = np.packbits(matrix, axis=1, bitorder="little")  # bit j of a row -> bit j of the int
        return [int.from_bytes(row.tobytes(), "little") for row in packed]

    return rows_as_ints(adj), rows_as_ints(adj.T)


def _bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, smallest first."""
    while mask:
        low = mask & -mask  # two's complement isolates the lowest set bit
        yield low.bit_length() - 1
        mask ^= low


def _strongly_connected(succ: list[int], pred: list[int]) -> bool:
    """Whether every node reaches node 0 and is reached from it."""
    full = (1 << len(succ)) - 1
    for edges in (succ, pred):
        seen = frontier = 1
        while frontier:
            reached = 0
            for v in _bits(frontier):
                reached |= edges[v]
            frontier = reached & ~seen
            seen |= frontier
        if seen != full:
            return False
    return True


def _has_cycle_cover(succ: list[int]) -> bool:
    """Whether the nodes split into disjoint directed cycles (a perfect matching of "out" to "in" copies).

    Kuhn's augmenting-path algorithm with breadth-first searches; O(n * edges). Every Hamiltonian cycle
    is such a cover.
    """
    n = len(succ)
    owner = [-1] * n  # owner[j]: the node whose out-edge enters j in the current matching
    target = [-1] * n  # target[u]: where u's out-edge goes in the current matching
    for u in range(n):
        reached_from: dict[int, int] = {}  # j -> the node whose out-edge reached j in this search
        seen, frontier, free = 0, [u], -1
        while frontier and free < 0:
            following = []
            for x in frontier:
                for j in _bits(succ[x] & ~seen):
                    seen |= 1 << j
                    reached_from[j] = x
                    if owner[j] < 0:
                        free = j
                        break
                    following.append(owner[j])
                if free >= 0:
                    break
            frontier = following
        if free < 0:
            return False
        # Flip the alternating path back from `free` to u: each node on it takes the edge that reached
        # its new target and frees its old one for the node before it.
        j = free
        while j >= 0:
            x = reached_from[j]
            previous = target[x]  # -1 once x is u, which had no edge yet
            owner[j], target[x] = x, j
            j = previous
    return True


def _upper_bound(bw: np.ndarray, values: np.ndarray, lower: float) -> float:
    """Largest threshold >= ``lower`` whose graph is strongly connected and has a cycle cover.

    Both conditions are necessary for a Hamiltonian cycle and monotone in the threshold, so a binary
    search finds the bound, and no ring can have a larger bottleneck.
    """
    candidates = values[values >= lower]
    lo, hi = 0, len(candidates)  # candidates[lo] passes (it has a ring: the one that gave `lower`)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        succ, pred = _bitsets(bw, candidates[mid])
        if _strongly_connected(succ, pred) and _has_cycle_cover(succ):
            lo = mid
        else:
            hi = mid
    return float(candidates[lo])


def _greedy_ring(bw: np.ndarray) -> list[int]:
    """Best of the nearest-neighbour tours from every start, in the max-bottleneck sense.

    From each start, repeatedly move to the unvisited node with the fastest link (smallest index on
    ties); O(n^3) in total, with an O(n) numpy step per move.
    """
    n = bw.shape[0]
    best_order: list[int] = []
    best_value = -1.0
    for start in range(n):
        order = [start]
        visited = np.zeros(n, dtype=bool)
        visited[start] = True
        for _ in range(n - 1):
            rates = np.where(visited, -1.0, bw[order[-1]])  # -1 < any rate: never revisit
            nxt = int(np.argmax(rates))  # argmax returns the first maximum: the smallest index
            order.append(nxt)
            visited[nxt] = True
        value = _bottleneck(bw, order)
        if value > best_value:
            best_order, best_value = order, value
    return rotate_to(best_order, 0)


def _enumerate_rings(bw: np.ndarray) -> list[int]:
    """n <= 3: the one or two possible rings, compared directly (smaller order wins ties)."""
    n = bw.shape[0]
    if n <= 2:
        return list(range(n))
    forward, backward = [0, 1, 2], [0, 2, 1]
    return backward if _bottleneck(bw, backward) > _bottleneck(bw, forward) else forward


# ---------------------------------------------------------------------------------------------------------
# Exact solver: binary search over thresholds, Hamiltonicity by a vectorised bitmask dynamic programme.


@functools.lru_cache(maxsize=4)
def _dp_layers(m: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Index arrays for the dynamic programme over subsets of ``m`` bits.

    ``layers[k - 1][i]`` holds (the subsets of size k that contain bit i, the same subsets without bit i),
    so one numpy expression computes bit i of every size-k entry from the size-(k - 1) entries.
    """
    masks = np.arange(1 << m, dtype=np.int64)
    popcount = np.zeros(1 << m, dtype=np.int64)
    for i in range(m):
        popcount += (masks >> i) & 1
    layers = []
    for k in range(1, m + 1):
        layer = masks[popcount == k]
        per_bit = []
        for i in range(m):
            with_i = layer[(layer >> i) & 1 == 1]
            per_bit.append((with_i, with_i ^ (1 << i)))
        layers.append(per_bit)
    return layers


def _paths_home(succ: list[int]) -> np.ndarray:
    """The dynamic programme: which paths can finish a ring back to node 0.

    Nodes 1..n-1 are bits 0..n-2 of a subset mask. ``home[S]`` is a bitmask of the nodes u in S from which
    a path exists that starts at u, visits exactly the nodes of S and then steps to node 0. Then

        home[{u}] holds u  iff  u -> 0 is an edge,
        home[S]   holds u  iff  u is in S and home[S - {u}] holds some w with u -> w an edge,

    and the graph has a Hamiltonian cycle iff home[all] holds a successor of node 0. Sizes are filled in
    increasing order; each (size, bit) pair is one vectorised step, so the whole table costs
    O(2^n * n) numpy element operations (n^2 numpy calls).
    """
    m = len(succ) - 1
    shifted = [s >> 1 for s in succ]  # successor sets in subset-bit numbering (node v -> bit v - 1)
    home = np.zeros(1 << m, dtype=np.int64)
    for i in range(m):
        if succ[i + 1] & 1:  # node i + 1 -> node 0
            home[1 << i] = 1 << i
    for per_bit in _dp_layers(m)[1:]:
        for i, (with_i, without_i) in enumerate(per_bit):
            can_continue = (home[without_i] & shifted[i + 1]) != 0
            home[with_i[can_continue]] |= 1 << i  # each subset appears once per bit: no lost updates
    return home


def _exact_ring(bw: np.ndarray) -> list[int]:
    """Optimal ring for 4 <= n <= 20; among optimal rings, the lexicographically smallest."""
    n = bw.shape[0]
    full = (1 << (n - 1)) - 1
    values = _edge_values(bw)
    lower = _bottleneck(bw, _greedy_ring(bw))
    upper = _upper_bound(bw, values, lower)
    candidates = values[(values >= lower) & (values <= upper)]
    lo, hi = 0, len(candidates)  # invariant: candidates[lo] is feasible, candidates[hi:] are not
    feasible_home: tuple[list[int], np.ndarray] | None = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        succ, _ = _bitsets(bw, candidates[mid])
        home = _paths_home(succ)
        if int(home[full]) & (succ[0] >> 1):
            lo, feasible_home = mid, (succ, home)
        else:
            hi = mid
    if feasible_home is None:  # nothing beat the greedy ring: rebuild it as the smallest optimal ring
        succ, _ = _bitsets(bw, candidates[lo])
        feasible_home = (succ, _paths_home(succ))
    succ, home = feasible_home
    # Walk from node 0, always to the smallest-indexed successor that can still complete the ring.
    order, remaining = [0], full
    while remaining:
        options = (succ[order[-1]] >> 1) & int(home[remaining])
        bit = (options & -options).bit_length() - 1  # never empty: home[remaining] guarantees a way on
        order.append(bit + 1)
        remaining ^= 1 << bit
    return order


# ---------------------------------------------------------------------------------------------------------
# Heuristic solver: binary search over thresholds, Hamiltonicity by a bounded constraint search.


def _heuristic_ring(bw: np.ndarray) -> list[int]:
    """A good ring for large n; optimal whenever its bottleneck reaches the upper bound."""
    values = _edge_values(bw)
    best = _greedy_ring(bw)
    lower = _bottleneck(bw, best)
    upper = _upper_bound(bw, values, lower)
    candidates = values[(values > lower) & (values <= upper)]
    lo, hi = -1, len(candidates)  # index -1 stands for `lower`, which `best` achieves
    mid = hi - 1  # try the upper bound first: it is often reached, and then the ring is optimal
    while hi - lo > 1:
        found = _find_cycle(*_bitsets(bw, candidates[mid]), HEURISTIC_SEARCH_STEPS)
        if found is None:
            hi = mid  # not proof of infeasibility, only that the bounded search gave up
        else:
            best = found
            # The ring may beat the threshold it was searched at: skip every threshold it already meets.
            lo = int(np.searchsorted(candidates, _bottleneck(bw, found), side="right")) - 1
        mid = (lo + hi) // 2
    return rotate_to(best, 0)


def _find_cycle(succ: list[int], pred: list[int], max_steps: int) -> list[int] | None:
    """Search for a Hamiltonian cycle of the graph given by its successor and predecessor bitsets.

    A depth-first search over edge choices with constraint propagation. The state is the set of edges
    still allowed; a step fixes the successor of the node with the fewest choices left (trying first the
    successor that the fewest other nodes could precede) and ``_propagate`` then removes every edge that
    can no longer be on a Hamiltonian cycle. The search returns ``None`` after ``max_steps`` steps.
    """
    n = len(succ)
    succ, pred = list(succ), list(pred)
    if not _propagate(succ, pred, list(range(n))):
        return None
    frames = [(succ, pred, _branch_node(succ))]
    tried: list[list[int]] = [_ranked_successors(succ, pred, frames[0][2])]
    steps = 0
    while frames:
        succ, pred, node = frames[-1]
        if node < 0:  # every node has exactly one successor left: propagation made it one cycle
            return _read_cycle(succ)
        if not tried[-1]:
            frames.pop()
            tried.pop()
            continue
        steps += 1
        if steps > max_steps:
            return None
        target = tried[-1].pop()
        succ, pred = list(succ), list(pred)
        dropped = succ[node] & ~(1 << target)
        succ[node] = 1 << target
        for other in _bits(dropped):
            pred[other] &= ~(1 << node)
        if _propagate(succ, pred, [node, target, *_bits(dropped)]):
            branch = _branch_node(succ)
            frames.append((succ, pred, branch))
            tried.append(_ranked_successors(succ, pred, branch) if branch >= 0 else [])
    return None


def _branch_node(succ: list[int]) -> int:
    """The node with the fewest (but at least two) successors left, smallest index on ties; -1 if none."""
    choices = [(s.bit_count(), v) for v, s in enumerate(succ) if s & (s - 1)]  # s & (s - 1): two or more bits
    return min(choices)[1] if choices else -1


def _ranked_successors(succ: list[int], pred: list[int], node: int) -> list[int]:
    """Successors of ``node``, best last (the search pops from the end): fewest rival predecessors first."""
    ranked = sorted(_bits(succ[node]), key=lambda w: (pred[w].bit_count(), w))
    return ranked[::-1]


def _read_cycle(succ: list[int]) -> list[int]:
    """The cycle through node 0 when every node has a single successor."""
    order = [0]
    while len(order) < len(succ):
        order.append(succ[order[-1]].bit_length() - 1)
    return order


def _propagate(succ: list[int], pred: list[int], changed: list[int]) -> bool:
    """Remove the edges no Hamiltonian cycle can use; False if some node is left without a way in or out.

    Two rules, to a fixed point: a node with a single successor w (or a single predecessor x) owns that
    edge, so nobody else may enter w (nor may x leave to anyone else); and an edge from the end of a chain
    of owned edges back to its start would close a cycle that misses nodes, so it goes. ``changed`` lists
    the nodes whose edge sets changed; the lists are edited in place.
    """
    while True:
        if not _propagate_degrees(succ, pred, changed):
            return False
        if not _cut_subtours(succ, pred, changed):
            return False
        if not changed:
            return True


def _propagate_degrees(succ: list[int], pred: list[int], changed: list[int]) -> bool:
    """The first rule of ``_propagate``, for the nodes in ``changed`` and those it changes in turn."""
    while changed:
        v = changed.pop()
        out_set, in_set = succ[v], pred[v]
        if not out_set or not in_set:
            return False
        if not out_set & (out_set - 1):  # exactly one successor w: v -> w is forced
            w = out_set.bit_length() - 1
            rivals = pred[w] & ~(1 << v)
            if rivals:
                pred[w] = 1 << v
                for x in _bits(rivals):
                    succ[x] &= ~(1 << w)
                    changed.append(x)
        if not in_set & (in_set - 1):  # exactly one predecessor x: x -> v is forced
            x = in_set.bit_length() - 1
            rivals = succ[x] & ~(1 << v)
            if rivals:
                succ[x] = 1 << v
                for y in _bits(rivals):
                    pred[y] &= ~(1 << x)
                    changed.append(y)
                changed.append(x)
    return True


def _cut_subtours(succ: list[int], pred: list[int], changed: list[int]) -> bool:
    """The second rule of ``_propagate``: False if forced edges already close a cycle shorter than n.

    Runs when the degree rule is at its fixed point, where "x has the single successor y" and "y has the
    single predecessor x" mean the same thing, so forced edges form disjoint chains and cycles.
    """
    n = len(succ)
    forced_next = [s.bit_length() - 1 if not s & (s - 1) else -1 for s in succ]
    entered = 0  # nodes with a forced incoming edge
    for y in forced_next:
        if y >= 0:
            entered |= 1 << y
    on_chain = 0
    for head in range(n):
        if forced_next[head] < 0 or entered >> head & 1:
            continue
        tail, length = head, 1
        while forced_next[tail] >= 0:
            on_chain |= 1 << tail
            tail, length = forced_next[tail], length + 1
        on_chain |= 1 << tail
        if length < n and succ[tail] >> head & 1:
            succ[tail] &= ~(1 << head)
            pred[head] &= ~(1 << tail)
            changed.extend((tail, head))
    # Nodes with forced edges both in and out that no chain reached lie on cycles of forced edges.
    on_cycle = entered & ~on_chain
    if on_cycle:
        start = (on_cycle & -on_cycle).bit_length() - 1
        length, node = 1, forced_next[start]
        while node != start:
            length, node = length + 1, forced_next[node]
        return length == n
    return True
