"""Tests for the bottleneck-TSP ring order (openprime.mesh.ring_order).

The exact solver is checked against brute force over every ring; the heuristic against the exact solver
and against instances whose answer is known by construction (a planted fast cycle, two clusters).
"""

from __future__ import annotations

import functools
import itertools
import math
import time

import numpy as np
import pytest

from openprime.mesh.ring_order import EXACT_MAX_NODES, best_ring, ring_bottleneck, rotate_to


def assert_valid_ring(order: list[int], n: int) -> None:
    assert order[0] == 0
    assert sorted(order) == list(range(n))


@functools.cache
def rings_in_lexicographic_order(n: int) -> np.ndarray:
    """Every ring of n nodes starting at node 0, one per row, in lexicographic order."""
    return np.array([(0, *rest) for rest in itertools.permutations(range(1, n))], dtype=np.intp)


def brute_force(bw: np.ndarray) -> tuple[list[int], float]:
    """The lexicographically first ring with the largest bottleneck, and that bottleneck."""
    bw = np.nan_to_num(np.asarray(bw, dtype=np.float64), nan=0.0)
    rings = rings_in_lexicographic_order(bw.shape[0])
    bottlenecks = bw[rings, np.roll(rings, -1, axis=1)].min(axis=1)
    best = int(np.argmax(bottlenecks))  # argmax takes the first maximum: the lexicographically first ring
    return rings[best].tolist(), float(bottlenecks[best])


def random_matrix(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "asymmetric":
        return rng.uniform(1e8, 1e10, (n, n))
    if kind == "symmetric":
        bw = rng.uniform(1e8, 1e10, (n, n))
        return np.minimum(bw, bw.T)
    return rng.integers(0, 4, (n, n)).astype(np.float64)  # "ties": few distinct values, zeros = unknown


def planted(rng: np.random.Generator, n: int, decoys: float) -> tuple[np.ndarray, list[int], float]:
    """Slow random links plus a hidden fast ring; ``decoys / n`` of the other links are fast as well.

    Returns the matrix, the planted ring (from node 0) and its bottleneck. Without decoys the planted ring
    is the only ring whose links are all fast, so it is the unique optimum.
    """
    bw = rng.uniform(0.0, 0.5, (n, n))
    fast = rng.random((n, n)) < decoys / n
    bw[fast] = rng.uniform(0.5, 1.0, int(fast.sum()))
    ring = rng.permutation(n)
    bw[ring, np.roll(ring, -1)] = rng.uniform(0.6, 1.0, n)
    ring_list = rotate_to(ring.tolist(), 0)
    return bw, ring_list, ring_bottleneck(bw, ring_list)


def two_clusters(rng: np.random.Generator, sizes: tuple[int, int]) -> tuple[np.ndarray, float]:
    """Two clusters with fast links inside and slow (asymmetric, random) links between them.

    Returns the matrix and the best possible bottleneck, computed independently: a ring leaves each
    cluster at least once, and once is best, so it crosses exactly twice, A -> B and B -> A, through
    four distinct nodes (both clusters have at least two nodes), and its bottleneck is the slower of the
    two crossings.
    """
    a, b = sizes
    n = a + b
    bw = rng.uniform(1e9, 2e9, (n, n))  # slow between clusters
    bw[:a, :a] = rng.uniform(5e9, 9e9, (a, a))
    bw[a:, a:] = rng.uniform(5e9, 9e9, (b, b))
    best = max(
        min(bw[x, y], bw[y2, x2])
        for x, x2 in itertools.permutations(range(a), 2)
        for y, y2 in itertools.permutations(range(a, n), 2)
    )
    return bw, best


def crossings(order: list[int], a: int) -> int:
    return sum((u < a) != (v < a) for u, v in zip(order, order[1:] + order[:1], strict=True))


# ---------------------------------------------------------------------------------------------------------
# Exact solver


@pytest.mark.parametrize("n", range(2, 10))
@pytest.mark.parametrize("kind", ["asymmetric", "symmetric", "ties"])
def test_exact_matches_brute_force(n: int, kind: str) -> None:
    for seed in range(4 if n < 9 else 2):
        bw = random_matrix(np.random.default_rng([n, seed, len(kind)]), n, kind)
        order = best_ring(bw)
        assert_valid_ring(order, n)
        expected_order, expected = brute_force(bw)
        assert ring_bottleneck(bw, order) == expected
        # Ties (frequent in "ties") go to the lexicographically smallest optimal ring.
        assert order == expected_order


def test_exact_finds_planted_ring_n16() -> None:
    rng = np.random.default_rng(16)
    for _ in range(3):
        bw, ring, value = planted(rng, 16, decoys=0)
        order = best_ring(bw)
        assert order == ring  # the unique optimum
        assert ring_bottleneck(bw, order) == value
    for _ in range(3):
        bw, _, value = planted(rng, 16, decoys=2)
        assert ring_bottleneck(bw, best_ring(bw)) >= value


def test_exact_two_clusters_cross_twice() -> None:
    rng = np.random.default_rng(2)
    for sizes in [(5, 6), (2, 8), (7, 7)]:
        bw, expected = two_clusters(rng, sizes)
        order = best_ring(bw)
        assert ring_bottleneck(bw, order) == expected
        # Guaranteed in general is only that some optimal ring crosses twice; a ring crossing four times
        # can tie in rare cases (when segments of one node line up). With these seeds, as in 400 of 400
        # random trials measured, the returned ring crosses exactly twice.
        assert crossings(order, sizes[0]) == 2


def test_exact_n16_time() -> None:
    bw = np.random.default_rng(1616).uniform(1e8, 1e10, (16, 16))
    start = time.perf_counter()
    order = best_ring(bw)
    elapsed = time.perf_counter() - start
    print(f"exact n=16: {elapsed * 1000:.1f} ms")
    assert_valid_ring(order, 16)
    assert elapsed < 5.0


# ---------------------------------------------------------------------------------------------------------
# Heuristic solver


def test_heuristic_n64_time() -> None:
    rng = np.random.default_rng(64)
    for kind in ["asymmetric", "symmetric"]:
        bw = random_matrix(rng, 64, kind)
        start = time.perf_counter()
        order = best_ring(bw)
        elapsed = time.perf_counter() - start
        print(f"heuristic n=64 {kind}: {elapsed * 1000:.1f} ms, bottleneck {ring_bottleneck(bw, order):.4g}")
        assert_valid_ring(order, 64)
        assert elapsed < 5.0


@pytest.mark.parametrize("n", [24, 32, 64])
def test_heuristic_finds_planted_ring(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(3):
        bw, ring, value = planted(rng, n, decoys=0)
        assert best_ring(bw) == ring
    # Decoy fast links make the threshold graph a sparse random graph around the planted ring; the optimum
    # may then beat the planted ring, and must not fall below it.
    for decoys in [1, 2, 4]:
        bw, _, value = planted(rng, n, decoys)
        assert ring_bottleneck(bw, best_ring(bw)) >= value


def test_heuristic_two_clusters() -> None:
    bw, expected = two_clusters(np.random.default_rng(3), (11, 13))
    order = best_ring(bw)
    assert ring_bottleneck(bw, order) == expected
    assert crossings(order, 11) == 2


def test_heuristic_against_exact() -> None:
    matches, ratios = 0, []
    cases = [(n, seed, kind) for n in (10, 11, 12) for seed in range(8) for kind in ("asymmetric", "symmetric")]
    for n, seed, kind in cases:
        bw = random_matrix(np.random.default_rng([n, seed, 7]), n, kind)
        exact = ring_bottleneck(bw, best_ring(bw))
        order = best_ring(bw, exact_max_nodes=0)
        assert_valid_ring(order, n)
        heuristic = ring_bottleneck(bw, order)
        assert heuristic <= exact
        matches += heuristic == exact
        ratios.append(heuristic / exact)
    print(f"heuristic = exact in {matches}/{len(cases)} cases, mean ratio {np.mean(ratios):.4f}")
    # Measured: 48/48 (and 300/300 on a wider sweep, n = 10..16). The bound leaves room for small changes.
    assert matches >= 0.9 * len(cases)
    assert np.mean(ratios) >= 0.99


# ---------------------------------------------------------------------------------------------------------
# Inputs and edge cases


@pytest.mark.parametrize("exact_max_nodes", [EXACT_MAX_NODES, 0])
def test_unknown_links_are_avoided(exact_max_nodes: int) -> None:
    # The fastest ring would use 0 -> 1, but that link is unknown (NaN), so the ring must avoid it.
    n = 6
    bw = np.full((n, n), 1.0)
    ring = [0, 1, 2, 3, 4, 5]
    bw[ring, np.roll(ring, -1)] = 10.0
    bw[0, 1] = np.nan
    bw[2, 4] = 0.0  # also unknown
    order = best_ring(bw, exact_max_nodes=exact_max_nodes)
    assert_valid_ring(order, n)
    assert ring_bottleneck(bw, order) == 1.0
    assert brute_force(bw)[1] == 1.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 20])
def test_all_unknown_still_returns_a_ring(n: int) -> None:
    bw = np.full((n, n), np.nan)
    order = best_ring(bw)
    assert order == list(range(n))  # every ring is equally bad: the smallest one
    assert ring_bottleneck(bw, order) == (math.inf if n == 1 else 0.0)


def test_mostly_unknown_heuristic() -> None:
    rng = np.random.default_rng(5)
    n = 40
    bw = rng.uniform(1.0, 2.0, (n, n))
    bw[rng.random((n, n)) < 0.7] = np.nan
    ring = rotate_to(rng.permutation(n).tolist(), 0)
    bw[ring, np.roll(ring, -1)] = 1.5  # make sure some ring of known links exists
    order = best_ring(bw)
    assert_valid_ring(order, n)
    assert ring_bottleneck(bw, order) >= 1.5


@pytest.mark.parametrize("exact_max_nodes", [EXACT_MAX_NODES, 0])
def test_direction_matters(exact_max_nodes: int) -> None:
    # 0 -> 1 -> 2 -> 3 -> 4 -> 0 is fast one way only; the ring must send data that way.
    n = 5
    bw = np.full((n, n), 1.0)
    bw[np.arange(n), (np.arange(n) + 1) % n] = 10.0
    assert best_ring(bw, exact_max_nodes=exact_max_nodes) == [0, 1, 2, 3, 4]
    assert best_ring(bw.T, exact_max_nodes=exact_max_nodes) == [0, 4, 3, 2, 1]


def test_small_rings() -> None:
    assert best_ring([[0.0]]) == [0]
    assert ring_bottleneck([[5.0]], [0]) == math.inf
    assert best_ring([[0, 3], [7, 0]]) == [0, 1]
    assert ring_bottleneck([[0, 3], [7, 0]], [0, 1]) == 3
    three = [[0, 1, 5], [5, 0, 1], [1, 5, 0]]  # only 0 -> 2 -> 1 -> 0 is fast
    assert best_ring(three) == [0, 2, 1]
    assert ring_bottleneck(three, [0, 2, 1]) == 5


def test_deterministic_and_label_invariant() -> None:
    rng = np.random.default_rng(9)
    for n in (12, 30):
        bw = random_matrix(rng, n, "asymmetric")
        order = best_ring(bw)
        assert best_ring(bw.copy()) == order
        relabel = rng.permutation(n)  # node i becomes node relabel[i]
        moved = np.empty_like(bw)
        moved[np.ix_(relabel, relabel)] = bw
        if n <= EXACT_MAX_NODES:  # the heuristic's answer may depend on labels; the optimum does not
            assert ring_bottleneck(moved, best_ring(moved)) == ring_bottleneck(bw, order)


def test_diagonal_is_ignored() -> None:
    bw = np.random.default_rng(4).uniform(1, 2, (7, 7))
    noisy = bw.copy()
    np.fill_diagonal(noisy, [np.nan, 0, 100, -0.0, 5, 1e12, 3])
    assert best_ring(noisy) == best_ring(bw)


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        best_ring(np.ones((2, 3)))
    with pytest.raises(ValueError):
        best_ring(np.zeros((0, 0)))
    with pytest.raises(ValueError):
        best_ring(-np.ones((3, 3)))
    with pytest.raises(ValueError):
        best_ring(np.ones((4, 4)), exact_max_nodes=40)
    with pytest.raises(ValueError):
        ring_bottleneck(np.ones((3, 3)), [0, 1, 1])


def test_rotate_to() -> None:
    assert rotate_to([3, 1, 0, 2], 0) == [0, 2, 3, 1]
    assert rotate_to([0, 1], 0) == [0, 1]
    with pytest.raises(ValueError):
        rotate_to([0, 1], 5)
